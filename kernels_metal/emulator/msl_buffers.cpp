// Device buffers of emulated dispatches, each between two PROT_NONE guard pages, and the
// description of a fault in one of them. Also the bfloat16 conversion helpers clang calls.
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

namespace {

constexpr int kMaxBuffers = 256;

struct Buffer {
  char* map;
  size_t map_len, nbytes, padded;
  char* data;
  char name[64];
};

Buffer g_buffers[kMaxBuffers];
pthread_mutex_t g_buffers_lock = PTHREAD_MUTEX_INITIALIZER;

size_t g_page = 0;

size_t page_size() {
  if (g_page == 0) g_page = size_t(sysconf(_SC_PAGESIZE));  // no static local: no libstdc++
  return g_page;
}

Buffer* locked_find(void* data) {
  for (Buffer& b : g_buffers)
    if (b.map && b.data == data) return &b;
  return nullptr;
}

}  // namespace

// Describes a fault at `addr` if it hit a buffer or its guard pages; 0 if it did not.
// Runs in the fault handler: no locks, no allocation.
extern "C" int msl_buffer_describe_fault(const char* addr, const char* kind, char* msg, size_t n) {
  for (Buffer& b : g_buffers) {
    if (!b.map || addr < b.map || addr >= b.map + b.map_len) continue;
    if (addr < b.data) {
      snprintf(msg, n, "out-of-bounds %s %ld bytes before the start of buffer '%s'", kind,
               long(b.data - addr), b.name);
    } else if (addr >= b.data + b.nbytes) {
      snprintf(msg, n, "out-of-bounds %s at byte %ld of buffer '%s', which holds %zu bytes",
               kind, long(addr - b.data), b.name, b.nbytes);
    } else {
      snprintf(msg, n, "%s to read-only input buffer '%s' at byte %ld", kind, b.name,
               long(addr - b.data));
    }
    return 1;
  }
  return 0;
}

// A buffer of `nbytes`, NaN-filled. at_start = 0: the data ends at the guard page after it
// (overflows fault); at_start = 1: it begins right after the guard page before it (underflows).
extern "C" void* msl_buffer_alloc(size_t nbytes, const char* name, int at_start) {
  pthread_mutex_lock(&g_buffers_lock);
  Buffer* slot = nullptr;
  for (Buffer& b : g_buffers)
    if (!b.map) {
      slot = &b;
      break;
    }
  void* result = nullptr;
  if (slot) {
    size_t padded = (nbytes + 15) / 16 * 16;
    size_t data_pages = (padded + page_size() - 1) / page_size();
    if (data_pages == 0) data_pages = 1;
    size_t len = (data_pages + 2) * page_size();
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m != MAP_FAILED) {
      char* map = static_cast<char*>(m);
      mprotect(map, page_size(), PROT_NONE);
      mprotect(map + (data_pages + 1) * page_size(), page_size(), PROT_NONE);
      // Poison: uninitialised outputs read as NaN, and the canary around the data.
      memset(map + page_size(), 0xff, data_pages * page_size());
      slot->map = map;
      slot->map_len = len;
      slot->nbytes = nbytes;
      slot->padded = padded;
      slot->data = at_start ? map + page_size() : map + (data_pages + 1) * page_size() - padded;
      snprintf(slot->name, sizeof slot->name, "%s", name);
      result = slot->data;
    }
  }
  pthread_mutex_unlock(&g_buffers_lock);
  return result;
}

extern "C" int msl_buffer_set_readonly(void* data, int readonly) {
  pthread_mutex_lock(&g_buffers_lock);
  Buffer* b = locked_find(data);
  int rc = -1;
  if (b) {
    size_t data_pages = b->map_len / page_size() - 2;
    int prot = readonly ? PROT_READ : PROT_READ | PROT_WRITE;
    rc = mprotect(b->map + page_size(), data_pages * page_size(), prot);
  }
  pthread_mutex_unlock(&g_buffers_lock);
  return rc;
}

// The bytes between the data and the guard pages must still hold the poison pattern.
extern "C" int msl_buffer_check(void* data, char* err, int errlen) {
  pthread_mutex_lock(&g_buffers_lock);
  Buffer* b = locked_find(data);
  int rc = 0;
  if (b) {
    const unsigned char* lo = reinterpret_cast<unsigned char*>(b->map + page_size());
    const unsigned char* start = reinterpret_cast<unsigned char*>(b->data);
    const unsigned char* end = start + b->nbytes;
    const unsigned char* hi = reinterpret_cast<unsigned char*>(b->map + b->map_len - page_size());
    for (const unsigned char* p = lo; p < start && !rc; ++p)
      if (*p != 0xff) {
        snprintf(err, size_t(errlen),
                 "out-of-bounds write %ld bytes before the start of buffer '%s'",
                 long(start - p), b->name);
        rc = 1;
      }
    for (const unsigned char* p = end; p < hi && !rc; ++p)
      if (*p != 0xff) {
        snprintf(err, size_t(errlen),
                 "out-of-bounds write at byte %ld of buffer '%s', which holds %zu bytes",
                 long(p - start), b->name, b->nbytes);
        rc = 1;
      }
  }
  pthread_mutex_unlock(&g_buffers_lock);
  return rc;
}

extern "C" void msl_buffer_free(void* data) {
  pthread_mutex_lock(&g_buffers_lock);
  Buffer* b = locked_find(data);
  if (b) {
    munmap(b->map, b->map_len);
    memset(b, 0, sizeof *b);
  }
  pthread_mutex_unlock(&g_buffers_lock);
}

// Runs the dispatch once with the given thread order; 0 on success, else 1 with `err` set.

// ---------------------------------------------------------------- bfloat16 conversions
// clang lowers float -> __bf16 to these libgcc/compiler-rt helpers, which not every system
// runtime exports: provide them (round to nearest even, NaN stays NaN).
extern "C" __bf16 __truncsfbf2(float x) {
  uint32_t bits;
  memcpy(&bits, &x, 4);
  uint16_t out;
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    out = uint16_t((bits >> 16) | 0x40u);
  } else {
    bits += 0x7fffu + ((bits >> 16) & 1u);
    out = uint16_t(bits >> 16);
  }
  __bf16 r;
  memcpy(&r, &out, 2);
  return r;
}

extern "C" __bf16 __truncdfbf2(double x) {
  return __truncsfbf2(float(x));
}
