// Runs an emulated Metal compute dispatch: every threadgroup's threads are fibers on one OS
// thread, switched only at barriers and simdgroup functions, so barrier semantics are real.
// Device buffers (msl_buffers.cpp) sit between PROT_NONE guard pages: an out-of-bounds access
// faults, and the fault handler turns it into an error naming the buffer, instead of a crash.
#if defined(__APPLE__)
// macOS declares the ucontext functions only to X/Open code, and X/Open mode hides the BSD
// names used here (MAP_ANONYMOUS, MAP_NORESERVE) unless Darwin's own are asked for too.
#define _XOPEN_SOURCE 600
#define _DARWIN_C_SOURCE
#endif
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
// x86-64 ELF (Linux) switches fibers with a few instructions; elsewhere (Apple Silicon, or
// with MSL_USE_UCONTEXT) it falls back to ucontext, portable but a system call per switch.
#if defined(__x86_64__) && defined(__ELF__) && !defined(MSL_USE_UCONTEXT)
#define MSL_FAST_SWITCH 1
#else
#include <ucontext.h>
#endif

typedef unsigned int msl_uint3 __attribute__((ext_vector_type(3)));
typedef unsigned int uint;
typedef msl_uint3 uint3;
#include "msl_thread_info.h"

typedef void (*msl_entry_fn)(void* const* args, const msl_thread_info* info);
extern "C" int msl_buffer_describe_fault(const char* addr, const char* kind, char* msg, size_t n);

namespace {

constexpr int kMaxThreads = 1024;
constexpr int kSimdWidth = 32;
constexpr int kMaxSimdBytes = 64;
constexpr int kMaxSites = 64;
constexpr size_t kThreadgroupMemory = 32768;
constexpr size_t kStackSize = 256 * 1024;

enum State { READY, WAIT_TG, WAIT_SIMD, DONE };

const char* const kSimdNames[] = {
    "?", "simd_sum", "simd_product", "simd_max", "simd_min", "simd_and", "simd_or", "simd_xor",
    "simd_all", "simd_any", "simd_broadcast", "simd_broadcast_first", "simd_shuffle",
    "simd_shuffle_xor", "simd_shuffle_up", "simd_shuffle_down", "simd_shuffle_rotate_up",
    "simd_shuffle_rotate_down", "simd_prefix_exclusive_sum", "simd_prefix_inclusive_sum",
    "simd_prefix_exclusive_product", "simd_prefix_inclusive_product", "simd_is_first",
    "simd_ballot", "simdgroup_multiply_accumulate", "simdgroup_barrier"};
constexpr int kSimdBarrierTag = 25;

const char* simd_name(int tag) {
  return tag >= 0 && tag <= kSimdBarrierTag ? kSimdNames[tag] : "?";
}

struct Fiber {
  void* sp;
#if !defined(MSL_FAST_SWITCH)
  ucontext_t ctx;
#endif
  int state;
  unsigned lane, simd, wait_gen;
  int wait_tag;
  msl_thread_info info;
};

struct SimdGroup {
  int live, arrived, tag;
  unsigned bytes, gen;
  uint32_t arrived_mask, masks[2];
  unsigned char slots[2][kSimdWidth][kMaxSimdBytes];
};

struct Run {
  msl_entry_fn entry;
  void* const* args;
  Fiber fibers[kMaxThreads];
  char* stacks;
  size_t stacks_len;
  void* sched_sp;
#if !defined(MSL_FAST_SWITCH)
  ucontext_t sched_ctx;
#endif
  Fiber* current;
  int nthreads, live, exited, tg_arrived;
  SimdGroup simd[kMaxThreads / kSimdWidth];
  alignas(64) unsigned char arena[kThreadgroupMemory];
  size_t arena_used;
  unsigned site_epoch[kMaxSites], site_bytes[kMaxSites], site_offset[kMaxSites], epoch;
  bool failed;
  char error[2048];
  sigjmp_buf fault_env;
  char* altstack;
  int* order;
  long order_len;
};

Run* g_run = nullptr;
pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
size_t g_page = 4096;

void format_thread(char* out, size_t n, const Fiber* f) {
  const msl_thread_info& t = f->info;
  snprintf(out, n, "thread (%u,%u,%u) of threadgroup (%u,%u,%u)",
           t.thread_position_in_threadgroup.x,
           t.thread_position_in_threadgroup.y, t.thread_position_in_threadgroup.z,
           t.threadgroup_position_in_grid.x, t.threadgroup_position_in_grid.y,
           t.threadgroup_position_in_grid.z);
}

}  // namespace

// ---------------------------------------------------------------- context switching
#if defined(MSL_FAST_SWITCH)
extern "C" void msl_fiber_switch(void** save_sp, void* to_sp);
asm(R"(
.text
.globl msl_fiber_switch
.type msl_fiber_switch,@function
msl_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
.size msl_fiber_switch, .-msl_fiber_switch
.section .note.GNU-stack,"",@progbits
.text
)");
#endif

namespace {

void fiber_main();

void to_scheduler(Fiber* f) {
#if defined(MSL_FAST_SWITCH)
  msl_fiber_switch(&f->sp, g_run->sched_sp);
#else
  swapcontext(&f->ctx, &g_run->sched_ctx);
#endif
}

void resume(Fiber* f) {
  g_run->current = f;
#if defined(MSL_FAST_SWITCH)
  msl_fiber_switch(&g_run->sched_sp, f->sp);
#else
  swapcontext(&g_run->sched_ctx, &f->ctx);
#endif
  g_run->current = nullptr;
}

void start_fiber(Fiber* f, int index) {
  char* base = g_run->stacks + size_t(index) * (kStackSize + g_page) + g_page;
#if defined(MSL_FAST_SWITCH)
  uint64_t* sp = reinterpret_cast<uint64_t*>(base + kStackSize);
  *--sp = 0;                                            // return address of fiber_main: none
  *--sp = reinterpret_cast<uint64_t>(&fiber_main);      // `ret` of the first switch lands here
  for (int i = 0; i < 6; ++i) *--sp = 0;                // callee-saved registers
  f->sp = sp;
#else
  getcontext(&f->ctx);
  f->ctx.uc_stack.ss_sp = base;
  f->ctx.uc_stack.ss_size = kStackSize;
  f->ctx.uc_link = nullptr;
  makecontext(&f->ctx, fiber_main, 0);
#endif
}

[[noreturn]] void fail_here(const char* message) {
  Run* r = g_run;
  if (!r->failed) {
    r->failed = true;
    if (r->current) {
      char where[128];
      format_thread(where, sizeof where, r->current);
      snprintf(r->error, sizeof r->error, "%s (%s)", message, where);
    } else {
      snprintf(r->error, sizeof r->error, "%s", message);
    }
  }
  if (r->current) to_scheduler(r->current);
  abort();  // a failed fiber is never resumed
}

void release_simd(SimdGroup& g) {
  int p = g.gen & 1;
  g.masks[p] = g.arrived_mask;
  for (int i = 0; i < g_run->nthreads; ++i) {
    Fiber& f = g_run->fibers[i];
    if (&g_run->simd[f.simd] == &g && f.state == WAIT_SIMD) f.state = READY;
  }
  g.gen++;
  g.arrived = 0;
  g.arrived_mask = 0;
}

void fiber_main() {
  Run* r = g_run;
  Fiber* f = r->current;
  r->entry(r->args, &f->info);
  f->state = DONE;
  r->live--;
  r->exited++;
  SimdGroup& g = r->simd[f->simd];
  g.live--;
  if (r->tg_arrived > 0)
    fail_here("a thread returned while others wait at threadgroup_barrier (barrier in divergent "
              "control flow)");
  if (g.arrived > 0 && g.arrived == g.live) release_simd(g);
  to_scheduler(f);
  abort();
}

void set_info(Fiber& f, const uint32_t* grid, const uint32_t* tg, const uint32_t* tg_pos,
              const uint32_t* actual, uint32_t x, uint32_t y, uint32_t z) {
  msl_thread_info& t = f.info;
  uint32_t linear = x + y * actual[0] + z * actual[0] * actual[1];
  uint32_t count = actual[0] * actual[1] * actual[2];
  uint32_t dispatch = tg[0] * tg[1] * tg[2];
  t.dispatch_quadgroups_per_threadgroup = (dispatch + 3) / 4;
  t.dispatch_simdgroups_per_threadgroup = (dispatch + kSimdWidth - 1) / kSimdWidth;
  t.dispatch_threads_per_threadgroup = msl_uint3{tg[0], tg[1], tg[2]};
  t.grid_origin = msl_uint3{0, 0, 0};
  t.grid_size = msl_uint3{grid[0], grid[1], grid[2]};
  t.quadgroup_index_in_threadgroup = linear / 4;
  t.quadgroups_per_threadgroup = (count + 3) / 4;
  t.simdgroup_index_in_threadgroup = linear / kSimdWidth;
  t.simdgroups_per_threadgroup = (count + kSimdWidth - 1) / kSimdWidth;
  t.thread_execution_width = kSimdWidth;
  t.thread_index_in_quadgroup = linear % 4;
  t.thread_index_in_simdgroup = linear % kSimdWidth;
  t.thread_index_in_threadgroup = linear;
  t.thread_position_in_grid =
      msl_uint3{tg_pos[0] * tg[0] + x, tg_pos[1] * tg[1] + y, tg_pos[2] * tg[2] + z};
  t.thread_position_in_threadgroup = msl_uint3{x, y, z};
  t.threadgroup_position_in_grid = msl_uint3{tg_pos[0], tg_pos[1], tg_pos[2]};
  t.threadgroups_per_grid = msl_uint3{(grid[0] + tg[0] - 1) / tg[0], (grid[1] + tg[1] - 1) / tg[1],
                                      (grid[2] + tg[2] - 1) / tg[2]};
  t.threads_per_grid = t.grid_size;
  t.threads_per_simdgroup = kSimdWidth;
  t.threads_per_threadgroup = msl_uint3{actual[0], actual[1], actual[2]};
  f.lane = linear % kSimdWidth;
  f.simd = linear / kSimdWidth;
}

// A permutation of 0..n-1: ascending (order 0), descending (1), or shuffled by seed (>= 2).
void make_order(int* out, int n, int order) {
  for (int i = 0; i < n; ++i) out[i] = order == 1 ? n - 1 - i : i;
  if (order >= 2) {
    uint64_t s = 0x9e3779b97f4a7c15ull * uint64_t(order);
    for (int i = n - 1; i > 0; --i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      int j = int(s % uint64_t(i + 1));
      int t = out[i];
      out[i] = out[j];
      out[j] = t;
    }
  }
}

void describe_deadlock() {
  Run* r = g_run;
  char where[128];
  int tg = -1, sd = -1;
  for (int i = 0; i < r->nthreads; ++i) {
    if (r->fibers[i].state == WAIT_TG && tg < 0) tg = i;
    if (r->fibers[i].state == WAIT_SIMD && sd < 0) sd = i;
  }
  if (tg >= 0 && sd >= 0) {
    format_thread(where, sizeof where, &r->fibers[sd]);
    snprintf(r->error, sizeof r->error,
             "deadlock: threads wait at threadgroup_barrier while %s waits at %s "
             "(a barrier or simd function in divergent control flow)",
             where, simd_name(r->fibers[sd].wait_tag));
  } else {
    snprintf(r->error, sizeof r->error, "deadlock: no thread can make progress");
  }
  r->failed = true;
}

bool run_threadgroup(const uint32_t* grid, const uint32_t* tg, const uint32_t* tg_pos, int order) {
  Run* r = g_run;
  uint32_t actual[3];
  for (int d = 0; d < 3; ++d) {
    uint32_t left = grid[d] - tg_pos[d] * tg[d];
    actual[d] = left < tg[d] ? left : tg[d];
  }
  int n = int(actual[0] * actual[1] * actual[2]);
  r->nthreads = n;
  r->live = n;
  r->exited = 0;
  r->tg_arrived = 0;
  r->epoch++;
  r->arena_used = 0;
  int nsimd = (n + kSimdWidth - 1) / kSimdWidth;
  for (int s = 0; s < nsimd; ++s) {
    SimdGroup& g = r->simd[s];
    g.live = (s + 1) * kSimdWidth <= n ? kSimdWidth : n - s * kSimdWidth;
    g.arrived = 0;
    g.gen = 0;
    g.arrived_mask = 0;
  }
  int i = 0;
  for (uint32_t z = 0; z < actual[2]; ++z)
    for (uint32_t y = 0; y < actual[1]; ++y)
      for (uint32_t x = 0; x < actual[0]; ++x, ++i) {
        Fiber& f = r->fibers[i];
        set_info(f, grid, tg, tg_pos, actual, x, y, z);
        f.state = READY;
        start_fiber(&f, i);
      }
  int perm[kMaxThreads];
  make_order(perm, n, order);
  while (r->live > 0) {
    bool progressed = false;
    for (int k = 0; k < n; ++k) {
      Fiber* f = &r->fibers[perm[k]];
      if (f->state != READY) continue;
      resume(f);
      progressed = true;
      if (r->failed) return false;
    }
    if (!progressed) {
      describe_deadlock();
      return false;
    }
  }
  return true;
}

void on_fault(int, siginfo_t* si, void* uctx) {
  Run* r = g_run;
  const char* addr = static_cast<const char*>(si->si_addr);
  const char* kind = "access";
#if defined(__x86_64__) && defined(__linux__)
  const ucontext_t* uc = static_cast<const ucontext_t*>(uctx);
  kind = (uc->uc_mcontext.gregs[REG_ERR] & 2) ? "write" : "read";
#else
  (void)uctx;
#endif
  char msg[512];
  if (msl_buffer_describe_fault(addr, kind, msg, sizeof msg)) {
    // an out-of-bounds access next to a buffer, described by msl_buffers.cpp
  } else if (r->stacks && addr >= r->stacks && addr < r->stacks + r->stacks_len) {
    snprintf(msg, sizeof msg, "stack overflow in an emulated thread (%zu KB per thread)",
             kStackSize / 1024);
  } else {
    snprintf(msg, sizeof msg,
             "invalid memory %s at %p (not next to any buffer: a wild pointer, or a misaligned "
             "vector access)", kind, static_cast<const void*>(addr));
  }
  if (r->current) {
    char where[128];
    format_thread(where, sizeof where, r->current);
    snprintf(r->error, sizeof r->error, "%s (%s)", msg, where);
  } else {
    snprintf(r->error, sizeof r->error, "%s", msg);
  }
  r->failed = true;
  siglongjmp(r->fault_env, 1);
}

bool ensure_stacks(int n) {
  Run* r = g_run;
  size_t need = size_t(n) * (kStackSize + g_page);
  if (r->stacks_len >= need) return true;
  if (r->stacks) munmap(r->stacks, r->stacks_len);
  void* m = mmap(nullptr, need, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                 -1, 0);
  if (m == MAP_FAILED) return false;
  r->stacks = static_cast<char*>(m);
  r->stacks_len = need;
  for (int i = 0; i < n; ++i)
    mprotect(r->stacks + size_t(i) * (kStackSize + g_page), g_page, PROT_NONE);  // overflow
  return true;
}

Run* get_run() {
  if (!g_run) {
    g_page = size_t(sysconf(_SC_PAGESIZE));
    g_run = static_cast<Run*>(calloc(1, sizeof(Run)));
    g_run->altstack = static_cast<char*>(malloc(1 << 16));
  }
  return g_run;
}

}  // namespace

// ---------------------------------------------------------------- hooks called by kernels
extern "C" unsigned msl_rt_lane(void) {
  return g_run->current->lane;
}

extern "C" void msl_rt_fail(const char* message) {
  fail_here(message);
}

extern "C" void msl_rt_threadgroup_barrier(void) {
  Run* r = g_run;
  Fiber* f = r->current;
  if (r->exited > 0)
    fail_here("threadgroup_barrier reached after another thread of the threadgroup returned "
              "(barrier in divergent control flow)");
  SimdGroup& g = r->simd[f->simd];
  if (g.arrived > 0) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "threadgroup_barrier reached while other lanes of the simdgroup wait at %s "
             "(divergent control flow)", simd_name(g.tag));
    fail_here(msg);
  }
  f->state = WAIT_TG;
  if (++r->tg_arrived == r->live) {
    for (int i = 0; i < r->nthreads; ++i)
      if (r->fibers[i].state == WAIT_TG) r->fibers[i].state = READY;
    r->tg_arrived = 0;
  }
  to_scheduler(f);
}

extern "C" void msl_rt_simd_exchange(int tag, const void* mine, unsigned bytes, void* all,
                                     uint32_t* mask) {
  Run* r = g_run;
  Fiber* f = r->current;
  if (bytes > unsigned(kMaxSimdBytes)) fail_here("simd function argument larger than 64 bytes");
  SimdGroup& g = r->simd[f->simd];
  if (g.arrived == 0) {
    g.tag = tag;
    g.bytes = bytes;
  } else if (g.tag != tag || g.bytes != bytes) {
    char msg[256];
    snprintf(msg, sizeof msg,
             "simdgroup lanes diverged: this lane calls %s while others wait at %s", simd_name(tag),
             simd_name(g.tag));
    fail_here(msg);
  }
  int p = g.gen & 1;
  if (bytes) memcpy(g.slots[p][f->lane], mine, bytes);
  g.arrived_mask |= 1u << f->lane;
  f->state = WAIT_SIMD;
  f->wait_gen = g.gen;
  f->wait_tag = tag;
  if (++g.arrived == g.live) release_simd(g);
  to_scheduler(f);
  p = f->wait_gen & 1;
  uint32_t m = g.masks[p];
  if (mask) *mask = m;
  if (!all) return;
  unsigned char* out = static_cast<unsigned char*>(all);
  for (int l = 0; l < kSimdWidth; ++l) {
    if (m >> l & 1u)
      memcpy(out + size_t(l) * bytes, g.slots[p][l], bytes);
    else
      memset(out + size_t(l) * bytes, 0xff, bytes);
  }
}

extern "C" void msl_rt_simdgroup_barrier(void) {
  msl_rt_simd_exchange(kSimdBarrierTag, nullptr, 0, nullptr, nullptr);
}

extern "C" void* msl_rt_threadgroup_alloc(int site, unsigned bytes, unsigned align) {
  Run* r = g_run;
  if (site < 0 || site >= kMaxSites) fail_here("too many threadgroup declarations");
  if (r->site_epoch[site] != r->epoch) {
    size_t a = align < 16 ? 16 : align;
    size_t offset = (r->arena_used + a - 1) / a * a;
    if (offset + bytes > kThreadgroupMemory) {
      char msg[160];
      snprintf(msg, sizeof msg, "threadgroup memory of %zu bytes exceeds the 32 KB Metal allows",
               offset + bytes);
      fail_here(msg);
    }
    memset(r->arena + offset, 0xff, bytes);  // uninitialised: NaN / -1 until written
    r->site_epoch[site] = r->epoch;
    r->site_offset[site] = unsigned(offset);
    r->site_bytes[site] = bytes;
    r->arena_used = offset + bytes;
  } else if (r->site_bytes[site] != bytes) {
    fail_here("threadgroup declaration changed size");
  }
  return r->arena + r->site_offset[site];
}

extern "C" int msl_run(msl_entry_fn entry, void* const* args, const uint32_t* grid,
                       const uint32_t* tg, int order, char* err, int errlen) {
  pthread_mutex_lock(&g_lock);
  Run* r = get_run();
  r->entry = entry;
  r->args = args;
  r->failed = false;
  r->error[0] = 0;
  r->current = nullptr;
  uint32_t groups[3];
  long total = 1, threads = 1;
  for (int d = 0; d < 3; ++d) {
    groups[d] = tg[d] ? (grid[d] + tg[d] - 1) / tg[d] : 0;
    total *= groups[d];
    threads *= tg[d];
  }
  if (threads > kMaxThreads || threads <= 0) {
    snprintf(r->error, sizeof r->error, "threadgroup of %ld threads (Metal allows 1..1024)",
             threads);
    r->failed = true;
  } else if (!ensure_stacks(int(threads))) {
    snprintf(r->error, sizeof r->error, "cannot map fiber stacks");
    r->failed = true;
  }
  struct sigaction act, old_segv, old_bus;
  stack_t alt, old_alt;
  if (!r->failed) {
    alt.ss_sp = r->altstack;
    alt.ss_size = 1 << 16;
    alt.ss_flags = 0;
    sigaltstack(&alt, &old_alt);
    memset(&act, 0, sizeof act);
    act.sa_sigaction = on_fault;
    act.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_NODEFER;
    sigemptyset(&act.sa_mask);
    sigaction(SIGSEGV, &act, &old_segv);
    sigaction(SIGBUS, &act, &old_bus);
    if (sigsetjmp(r->fault_env, 1) == 0) {
      if (r->order_len < total) {
        free(r->order);
        r->order = static_cast<int*>(malloc(sizeof(int) * size_t(total)));
        r->order_len = total;
      }
      make_order(r->order, int(total), order);
      for (long k = 0; k < total && !r->failed; ++k) {
        uint32_t lin = uint32_t(r->order[k]);
        uint32_t pos[3] = {lin % groups[0], lin / groups[0] % groups[1],
                           lin / (groups[0] * groups[1])};
        run_threadgroup(grid, tg, pos, order);
      }
    }
    sigaction(SIGSEGV, &old_segv, nullptr);
    sigaction(SIGBUS, &old_bus, nullptr);
    sigaltstack(&old_alt, nullptr);
  }
  int rc = r->failed ? 1 : 0;
  if (rc) snprintf(err, size_t(errlen), "%s", r->error);
  r->current = nullptr;
  pthread_mutex_unlock(&g_lock);
  return rc;
}
