/* See exports.h: the fork check, and the C entry points that are not per
 * slot (per slot: zz_slots.c). */
#include "exports.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "_cgo_export.h"
#include "filter.h"

__attribute__((visibility("hidden"))) volatile int gmp_forked_child_flag;

/* Plain text that needs no JSON escaping (no '"', no '\\'): gmp_fork_error
 * writes it into a JSON string as it is. */
const char gmp_fork_message[] =
    "this process was forked from one that had loaded gpumempool; the Go runtime behind its "
    "pools does not survive fork(), so the pools it inherited cannot be used here. Use the 'spawn' or "
    "'forkserver' start method of multiprocessing (or torch.multiprocessing), or import gpumempool only in the "
    "processes that use it, after they start";

static void gmp_fork_child(void) { gmp_forked_child_flag = 1; }

/* Runs when the library is loaded: the handler then runs in every child
 * this process forks (os.fork, multiprocessing's fork, fork() in C). */
__attribute__((constructor)) static void gmp_fork_register(void) { pthread_atfork(NULL, NULL, gmp_fork_child); }

/* The refusal as the value Python reads: like bindings/pyerr's JSONWithin,
 * a buffer too small for it gets the message shortened (ending in "...";
 * gmp_fork_message is ASCII), never the value cut, and the length written
 * is returned; only a buffer too small for the kind alone is cut, as
 * snprintf would. */
static size_t gmp_fork_value(char* buf, size_t n) {
  static const char head[] = "{\"kind\":\"" GMP_ERROR_KIND_FORKED "\",\"message\":\"";
  static const char tail[] = "\"}";
  size_t frame = sizeof head - 1 + sizeof tail - 1, whole = strlen(gmp_fork_message);
  size_t room = n - 1 > frame ? n - 1 - frame : 0; /* for the message */
  size_t keep = whole;
  const char* dots = "";
  if (whole > room) {
    keep = room > 3 ? room - 3 : 0;
    dots = keep > 0 ? "..." : "";
  }
  int len = snprintf(buf, n, "%s%.*s%s%s", head, (int)keep, gmp_fork_message, dots, tail);
  return len < 0 ? 0 : (size_t)len;
}

size_t gmp_fork_error(char* buf, size_t n, int form) {
  char scratch[1];
  if (buf == NULL || n == 0) { /* the length alone, of the whole refusal */
    buf = scratch;
    n = sizeof scratch;
  } else if (form == GMP_ERROR_JSON) {
    return gmp_fork_value(buf, n);
  }
  const char* format = form == GMP_ERROR_JSON ? "{\"kind\":\"%s\",\"message\":\"%s\"}" : "%s: %s";
  int len = snprintf(buf, n, format, GMP_ERROR_KIND_FORKED, gmp_fork_message);
  return len < 0 ? 0 : (size_t)len;
}

/* 1 in a forked child: Python's layer asks before it calls anything. */
int gmp_in_forked_child(void) { return gmp_forked_child_flag != 0; }

uintptr_t gmp_slot_alloc_ex(int slot, size_t size, int device, uintptr_t stream, char* buf, size_t n, int* oom) {
  if (GMP_FORKED()) {
    gmp_fork_error(buf, n, GMP_ERROR_TEXT); /* C callers: torch's throwing entry point */
    return 0;
  }
  return gmpgo_slot_alloc_ex(slot, size, device, stream, buf, n, oom);
}

uintptr_t gmp_pool_alloc(int64_t pool, size_t size, int device, uintptr_t stream) {
  return GMP_FORKED() ? 0 : gmpgo_pool_alloc(pool, size, device, stream);
}

int gmp_pool_free(int64_t pool, uintptr_t ptr, size_t size, int device, uintptr_t stream) {
  return GMP_FORKED() ? -1 : gmpgo_pool_free(pool, ptr, size, device, stream);
}

/* In a forked child every call failed for the same reason. */
size_t gmp_last_error(int64_t pool, char* buf, size_t n) {
  if (GMP_FORKED()) return gmp_fork_error(buf, n, GMP_ERROR_TEXT);
  return gmpgo_last_error(pool, buf, n);
}

size_t gmp_last_error_value(int64_t pool, char* buf, size_t n) {
  if (GMP_FORKED()) return gmp_fork_error(buf, n, GMP_ERROR_JSON);
  return gmpgo_last_error_value(pool, buf, n);
}

void gmp_graph_begin(int slot, int device, uint64_t id0, uint64_t id1, void* filter) {
  if (GMP_FORKED()) { /* nobody will own torch's filter: destroy it (C++, no Go) */
    gmp_filter_delete(filter);
    return;
  }
  gmpgo_graph_begin(slot, device, id0, id1, filter);
}

void gmp_graph_refuse(int slot, const char* why) {
  if (!GMP_FORKED()) gmpgo_graph_refuse(slot, (char*)why);
}

void gmp_graph_end(int slot, int device, uint64_t id0, uint64_t id1) {
  if (!GMP_FORKED()) gmpgo_graph_end(slot, device, id0, id1);
}

void gmp_graph_release(int slot, int device, uint64_t id0, uint64_t id1) {
  if (!GMP_FORKED()) gmpgo_graph_release(slot, device, id0, id1);
}

/* gmp_pickle_scan's "the scan failed" (pickle.go's pickleFailed). */
#define PICKLE_FAILED 3

int gmp_pickle_scan(uint8_t* data, size_t n, int64_t max_depth, int64_t* ops, int64_t* pos, char* why, size_t why_len,
                    uint64_t* nodes, int64_t* depth) {
  if (GMP_FORKED()) {
    *nodes = 0;
    *depth = -1;
    gmp_fork_error(why, why_len, GMP_ERROR_TEXT); /* a reason, like the scan's own */
    return PICKLE_FAILED;
  }
  return gmpgo_pickle_scan(data, n, max_depth, ops, pos, why, why_len, nodes, depth);
}

uintptr_t gmp_py_alloc(int64_t handle, uint64_t size, int device, uintptr_t stream, char* buf, size_t n) {
  if (GMP_FORKED()) {
    gmp_fork_error(buf, n, GMP_ERROR_JSON);
    return 0;
  }
  return gmpgo_py_alloc(handle, size, device, stream, buf, n);
}

int gmp_py_free(int64_t handle, uintptr_t ptr, char* buf, size_t n) {
  if (GMP_FORKED()) {
    gmp_fork_error(buf, n, GMP_ERROR_JSON);
    return -1;
  }
  return gmpgo_py_free(handle, ptr, buf, n);
}
