/* A stand-in for cuBLAS and cuBLASLt (preloaded with fake_cudart.c): every
 * call torch 2.11 makes succeeds and computes nothing. Handles are dummies;
 * the heuristic query returns one algorithm needing no workspace. Torch
 * still allocates its cuBLAS workspaces through its allocator, which is
 * what matters here. */
#include <string.h>
#include <stddef.h>
int cublasCdotc_v2() { return 0; }
int cublasCdotu_v2() { return 0; }
int cublasCgelsBatched() { return 0; }
int cublasCgemmStridedBatched() { return 0; }
int cublasCgemm_v2() { return 0; }
int cublasCgemv_v2() { return 0; }
int cublasCgeqrfBatched() { return 0; }
int cublasCgetrfBatched() { return 0; }
int cublasCgetrsBatched() { return 0; }
int cublasCreate_v2(void **h) { *h = (void *)0x100; return 0; }
int cublasCtrsmBatched() { return 0; }
int cublasCtrsm_v2() { return 0; }
int cublasDdot_v2() { return 0; }
int cublasDestroy_v2() { return 0; }
int cublasDgelsBatched() { return 0; }
int cublasDgemmStridedBatched() { return 0; }
int cublasDgemm_v2() { return 0; }
int cublasDgemv_v2() { return 0; }
int cublasDgeqrfBatched() { return 0; }
int cublasDgetrfBatched() { return 0; }
int cublasDgetrsBatched() { return 0; }
int cublasDotEx() { return 0; }
int cublasDtrsmBatched() { return 0; }
int cublasDtrsm_v2() { return 0; }
int cublasGemmEx() { return 0; }
int cublasGemmStridedBatchedEx() { return 0; }
int cublasGetMathMode(void *h, int *m) { *m = 0; return 0; }
int cublasGetPointerMode_v2(void *h, int *m) { *m = 0; return 0; }
size_t cublasLtGetVersion(void) { return 130000; }
int cublasLtMatmul() { return 0; }
int cublasLtMatmulAlgoGetHeuristic(void *h, void *op, void *a, void *b, void *c, void *d, void *pref, int n, void *res, int *got) { memset(res, 0, 96); *got = 1; return 0; }
int cublasLtMatmulDescCreate(void **d, int a, int b) { *d = (void *)0x200; return 0; }
int cublasLtMatmulDescDestroy() { return 0; }
int cublasLtMatmulDescSetAttribute() { return 0; }
int cublasLtMatmulPreferenceCreate(void **d) { *d = (void *)0x400; return 0; }
int cublasLtMatmulPreferenceDestroy() { return 0; }
int cublasLtMatmulPreferenceSetAttribute() { return 0; }
int cublasLtMatrixLayoutCreate(void **d, int t, unsigned long long r, unsigned long long c, long long ld) { *d = (void *)0x300; return 0; }
int cublasLtMatrixLayoutDestroy() { return 0; }
int cublasLtMatrixLayoutSetAttribute() { return 0; }
int cublasSdot_v2() { return 0; }
int cublasSetMathMode() { return 0; }
int cublasSetPointerMode_v2() { return 0; }
int cublasSetStream_v2() { return 0; }
int cublasSetWorkspace_v2() { return 0; }
int cublasSgelsBatched() { return 0; }
int cublasSgemmEx() { return 0; }
int cublasSgemmStridedBatched() { return 0; }
int cublasSgemm_v2() { return 0; }
int cublasSgemv_v2() { return 0; }
int cublasSgeqrfBatched() { return 0; }
int cublasSgetrfBatched() { return 0; }
int cublasSgetrsBatched() { return 0; }
int cublasStrsmBatched() { return 0; }
int cublasStrsm_v2() { return 0; }
int cublasZdotc_v2() { return 0; }
int cublasZdotu_v2() { return 0; }
int cublasZgelsBatched() { return 0; }
int cublasZgemmStridedBatched() { return 0; }
int cublasZgemm_v2() { return 0; }
int cublasZgemv_v2() { return 0; }
int cublasZgeqrfBatched() { return 0; }
int cublasZgetrfBatched() { return 0; }
int cublasZgetrsBatched() { return 0; }
int cublasZtrsmBatched() { return 0; }
int cublasZtrsm_v2() { return 0; }
