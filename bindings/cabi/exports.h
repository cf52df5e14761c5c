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

/* Why a forked child is refused, and what to do. */
extern const char gmp_fork_message[];

/* Copies gmp_fork_message into buf (n bytes, NUL-terminated). */
void gmp_fork_error(char* buf, size_t n);

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
