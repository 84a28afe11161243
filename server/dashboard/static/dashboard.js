// The dashboard: polls /dashboard/state (docs/dashboard.md) and fills the page from it.
// Everything a client sent is set as text, never as markup. The API key, when the server
// wants one, lives in this tab's sessionStorage and goes in a header, never in a URL.
"use strict";

// On a server of several models, the page's ?model=NAME picks whose state it shows.
const STATE_URL = "/dashboard/state" + location.search;
const KEY_STORAGE = "metal-serve-api-key";
const refreshSeconds = Math.max(0.2, Number(new URLSearchParams(location.search).get("refresh")) || 1);

const FORMATS = {
  int: (v) => Math.round(v).toLocaleString("en-US"),
  percent: (v) => (100 * v).toFixed(1) + "%",
  rate: (v) => v.toFixed(1),
  speedup: (v) => v.toFixed(2),
  seconds: (v) => (v < 1 ? (1000 * v).toFixed(1) + " ms" : v.toFixed(2) + " s"),
  duration: formatDuration,
  bytes: formatBytes,
};

function formatDuration(seconds) {
  const s = Math.floor(seconds);
  if (s < 60) return s + "s";
  if (s < 3600) return Math.floor(s / 60) + "m " + (s % 60) + "s";
  return Math.floor(s / 3600) + "h " + Math.floor((s % 3600) / 60) + "m";
}

function formatBytes(bytes) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let value = bytes, unit = 0;
  while (value >= 1024 && unit < units.length - 1) { value /= 1024; unit += 1; }
  return (unit ? value.toFixed(1) : value) + " " + units[unit];
}

function lookup(state, path) {
  return path.split(".").reduce((node, key) => (node == null ? null : node[key]), state);
}

function show(text) {
  return text == null ? "–" : text;
}

function fillFields(state) {
  for (const el of document.querySelectorAll("[data-section]")) {
    el.hidden = lookup(state, el.dataset.section) == null;
  }
  for (const el of document.querySelectorAll("[data-field]")) {
    const value = lookup(state, el.dataset.field);
    const format = FORMATS[el.dataset.format];
    el.textContent = value == null ? "–" : format ? format(value) : String(value);
  }
  for (const el of document.querySelectorAll("[data-bar]")) {
    el.style.width = Math.min(100, 100 * (lookup(state, el.dataset.bar) || 0)) + "%";
  }
}

const COLUMNS = [
  (r) => r.id,
  (r) => r.api,
  (r) => r.status,
  (r) => FORMATS.seconds(r.age_s),
  (r) => (r.ttft_s == null ? null : FORMATS.seconds(r.ttft_s)),
  (r) => FORMATS.int(r.prompt_tokens),
  (r) => (r.cached_tokens == null ? null : FORMATS.int(r.cached_tokens)),
  (r) => FORMATS.int(r.computed_tokens),
  (r) => FORMATS.int(r.generated_tokens),
  (r) => FORMATS.int(r.preemptions),
  (r) => (r.draft_tokens ? r.accepted_draft_tokens + " / " + r.draft_tokens : null),
];

function fillRequests(rows) {
  const body = document.querySelector("#requests tbody");
  const fresh = [];
  for (const row of rows) {
    const tr = document.createElement("tr");
    tr.dataset.requestId = row.id;
    tr.dataset.status = row.status;
    COLUMNS.forEach((column, index) => {
      const td = document.createElement("td");
      td.textContent = show(column(row));
      if (index === 2) td.className = "status-" + row.status;
      tr.append(td);
    });
    fresh.push(tr);
    if (row.prompt != null) {
      const promptRow = document.createElement("tr");
      const td = document.createElement("td");
      td.colSpan = COLUMNS.length;
      td.className = "prompt-text";
      td.textContent = row.prompt;
      promptRow.append(td);
      fresh.push(promptRow);
    }
  }
  body.replaceChildren(...fresh);
  document.getElementById("no-requests").hidden = rows.length > 0;
}

function fillFallbacks(fallbacks) {
  const items = fallbacks.map((f) => {
    const li = document.createElement("li");
    li.textContent = f.kernel + " " + f.variant + ": " + f.reason;
    return li;
  });
  document.getElementById("kernel-fallbacks").replaceChildren(...items);
}

// ---- charts: small SVG line charts over the history's intervals -------------------------

const SVG = "http://www.w3.org/2000/svg";
const CHART = { width: 320, height: 110, left: 50, right: 6, top: 6, bottom: 16 };

function svgElement(name, attributes, text) {
  const el = document.createElementNS(SVG, name);
  for (const [key, value] of Object.entries(attributes)) el.setAttribute(key, value);
  if (text != null) el.textContent = text;
  return el;
}

function drawChart(id, history, series, format) {
  const points = history.points;
  const svg = document.getElementById(id);
  const values = series.flatMap((s) => points.map(s.value)).filter((v) => v != null);
  const top = Math.max(...values, 0) || 1;
  const { width, height, left, right, bottom } = CHART;
  const plotWidth = width - left - right, plotHeight = height - CHART.top - bottom;
  const x = (i) => left + (points.length > 1 ? (i * plotWidth) / (points.length - 1) : plotWidth);
  const y = (v) => CHART.top + plotHeight * (1 - v / top);
  const parts = [
    svgElement("line", { class: "axis", x1: left, y1: y(0), x2: width - right, y2: y(0) }),
    svgElement("line", { class: "axis", x1: left, y1: y(top), x2: width - right, y2: y(top) }),
    svgElement("text", { x: left - 4, y: y(top) + 4, "text-anchor": "end" }, format(top)),
    svgElement("text", { x: left - 4, y: y(0), "text-anchor": "end" }, "0"),
    svgElement("text", { x: left, y: height - 2 }, historyLabel(points, history.interval_s)),
    svgElement("text", { x: width - right, y: height - 2, "text-anchor": "end" }, "now"),
  ];
  for (const s of series) {
    const known = points.map((p, i) => [i, s.value(p)]).filter(([, v]) => v != null);
    if (known.length) {
      const coordinates = known.map(([i, v]) => x(i) + "," + y(v)).join(" ");
      parts.push(svgElement("polyline", { class: s.className, points: coordinates }));
    }
    for (const [i, v] of known) {  // dots: an interval alone between empty ones shows too
      parts.push(svgElement("circle", { class: s.className, cx: x(i), cy: y(v), r: 1.6 }));
    }
  }
  svg.replaceChildren(...parts);
}

function historyLabel(points, intervalSeconds) {
  if (!points.length) return "no data yet";
  return "−" + formatDuration(Date.now() / 1000 - points[0].t + intervalSeconds);
}

function percentile(name, key) {
  return (p) => (p[name] == null ? null : p[name][key]);
}

function drawCharts(history) {
  drawChart("chart-throughput", history,
            [{ value: (p) => p.output_tokens_per_s, className: "p50" }], FORMATS.rate);
  for (const [id, name] of [["chart-ttft", "ttft_s"], ["chart-itl", "itl_s"]]) {
    drawChart(id, history, [
      { value: percentile(name, "p50"), className: "p50" },
      { value: percentile(name, "p90"), className: "p90" },
    ], FORMATS.seconds);
  }
}

// ---- polling and the key ----------------------------------------------------------------

function storedKey() {
  return sessionStorage.getItem(KEY_STORAGE);
}

function askForKey(problem) {
  document.getElementById("main").hidden = true;
  document.getElementById("key-form").hidden = false;
  const error = document.getElementById("key-error");
  error.textContent = problem || "";
  error.hidden = !problem;
  setConnection("needs an API key", "");
  document.getElementById("key-input").focus();
}

function setConnection(text, className) {
  const el = document.getElementById("connection");
  el.textContent = text;
  el.className = "connection " + className;
}

let timer = null;

async function poll() {
  timer = null;
  const key = storedKey();
  if (document.body.dataset.needsKey === "true" && !key) {
    askForKey();
    return;
  }
  let response;
  try {
    response = await fetch(STATE_URL, {
      headers: key ? { Authorization: "Bearer " + key } : {},
      cache: "no-store",
    });
  } catch (error) {
    setConnection("server unreachable, retrying", "down");
    schedule();
    return;
  }
  if (response.status === 401) {
    sessionStorage.removeItem(KEY_STORAGE);
    askForKey(key ? "The server refused that key." : null);
    return;
  }
  if (!response.ok) {
    setConnection("the server answered " + response.status + ", retrying", "down");
    schedule();
    return;
  }
  render(await response.json());
  schedule();
}

function render(state) {
  document.getElementById("key-form").hidden = true;
  document.getElementById("main").hidden = false;
  fillFields(state);
  fillRequests(state.requests.list);
  fillFallbacks(state.kernels.fallbacks);
  drawCharts(state.history);
  const updated = new Date(state.time * 1000).toLocaleTimeString("en-GB");
  setConnection("live, updated " + updated, "live");
  document.body.dataset.updated = String(state.time);
  document.body.dataset.refreshes = String(Number(document.body.dataset.refreshes) + 1);
}

function schedule() {
  if (timer === null) timer = setTimeout(poll, refreshSeconds * 1000);
}

document.getElementById("key-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const input = document.getElementById("key-input");
  if (!input.value) return;
  sessionStorage.setItem(KEY_STORAGE, input.value);
  input.value = "";
  poll();
});

poll();
