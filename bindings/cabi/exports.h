/* gpumempool's C entry points are C functions that check for a forked child
 * before they call Go (the gmpgo_* functions cgo exports): Go's runtime does
 * not survive fork() (its other threads are gone), and a child entering it
 * can block forever. A child gets a refusal instead: NULL or -1, and the
 * reason from gmp_last_error. */
#ifndef GMP_EXPORTS_H
#define GMP_EXPORTS_H

#include <stddef.h>
#include <stdint.h>

/* 1 in a process forked from one that loaded this library (set by a
 * pthread_atfork child handler; nothing else in the child needs Go). */
extern volatile int gmp_forked_child_flag;
#define GMP_FORKED() __builtin_expect(gmp_forked_child_flag != 0, 0)

/* The kind of error a forked child is refused with: bindings/pyerr's
 * ForkedProcess (a Go test checks that they agree). */
#define GMP_ERROR_KIND_FORKED "ForkedProcessError"

/* Why a forked child is refused, and what to do. */
extern const char gmp_fork_message[];

/* The forms gmp_fork_error writes the refusal in. */
enum gmp_error_form {
  /* For C callers: "ForkedProcessError: <gmp_fork_message>", the C ABI's last
   * error (gmp_last_error) and what torch's throwing entry point throws. */
  GMP_ERROR_TEXT = 0,
  /* For Python: the value every error crosses to Python as (bindings/pyerr),
   * {"kind": "ForkedProcessError", "message": <gmp_fork_message>}: what
   * gmp_py_alloc / gmp_py_free and gmp_last_error_value give. */
  GMP_ERROR_JSON = 1,
};

/* Writes the refusal of a forked child into buf (n bytes, NUL-terminated)
 * in form. The text is cut like snprintf, and its full length returned; the
 * value's message is shortened instead, so that it still decodes (as the
 * Go side's values are), and the length written returned. buf NULL or n 0:
 * the full length alone. The one place the C side makes an error. */
size_t gmp_fork_error(char* buf, size_t n, int form);

/* The entry points of exports.c that torch_glue.c calls. */
uintptr_t gmp_slot_alloc_ex(int slot, size_t size, int device, uintptr_t stream, char* buf, size_t n, int* oom);
void gmp_graph_begin(int slot, int device, uint64_t id0, uint64_t id1, void* filter);
void gmp_graph_end(int slot, int device, uint64_t id0, uint64_t id1);
void gmp_graph_release(int slot, int device, uint64_t id0, uint64_t id1);
void gmp_graph_refuse(int slot, const char* why);

/* The Go side of every slot's entry points (slots.go): one function per kind,
 * told the slot. */
extern uintptr_t gmpgo_alloc(int slot, size_t size, int device, uintptr_t stream);
extern uintptr_t gmpgo_segment_alloc(int slot, size_t size, int device, uintptr_t stream);
extern void gmpgo_free(int slot, uintptr_t ptr, size_t size, int device, uintptr_t stream);
extern void gmpgo_init(int slot, int device_count);
extern void gmpgo_empty_cache(int slot);
extern void gmpgo_memory_fraction(int slot, double fraction, int device);
extern void gmpgo_record_stream(int slot, uintptr_t ptr, uintptr_t stream);
extern uintptr_t gmpgo_base_alloc(int slot, uintptr_t ptr, size_t* size);

/* Slot i's plain entry points: torch's alloc/free pair, torch.cuda.MemPool's
 * segment alloc, and the CUDAPluggableAllocator hooks (hooks.go). */
#define GMP_SLOT_ENTRY_POINTS(i)                                                              \
  uintptr_t gmp_alloc_##i(size_t size, int device, uintptr_t stream) {                        \
    return GMP_FORKED() ? 0 : gmpgo_alloc(i, size, device, stream);                          \
  }                                                                                           \
  uintptr_t gmp_segment_alloc_##i(size_t size, int device, uintptr_t stream) {                \
    return GMP_FORKED() ? 0 : gmpgo_segment_alloc(i, size, device, stream);                  \
  }                                                                                           \
  void gmp_free_##i(uintptr_t ptr, size_t size, int device, uintptr_t stream) {               \
    if (!GMP_FORKED()) gmpgo_free(i, ptr, size, device, stream);                             \
  }                                                                                           \
  void gmp_init_##i(int device_count) {                                                       \
    if (!GMP_FORKED()) gmpgo_init(i, device_count);                                          \
  }                                                                                           \
  void gmp_empty_cache_##i(void) {                                                            \
    if (!GMP_FORKED()) gmpgo_empty_cache(i);                                               \
  }                                                                                           \
  void gmp_memory_fraction_##i(double fraction, int device) {                                 \
    if (!GMP_FORKED()) gmpgo_memory_fraction(i, fraction, device);                           \
  }                                                                                           \
  void gmp_record_stream_##i(uintptr_t ptr, uintptr_t stream) {                               \
    if (!GMP_FORKED()) gmpgo_record_stream(i, ptr, stream);                                  \
  }                                                                                           \
  uintptr_t gmp_base_alloc_##i(uintptr_t ptr, size_t* size) {                                 \
    return GMP_FORKED() ? 0 : gmpgo_base_alloc(i, ptr, size);                                \
  }

#endif
