/* gpumempool._fastcall: MemPool.alloc / free without gopy's per-call cost.
 *
 * gopy's generated wrappers release and retake the GIL and convert Go's
 * (value, error) results on every call, which costs more than the engine's
 * cache hit. This module calls the two C functions the Go extension exports
 * for the purpose (bindings/cabi/pyfast.go: gmp_py_alloc, gmp_py_free) from
 * the very library Python imported, found by path with dlopen(RTLD_NOLOAD).
 *
 * The GIL stays held during the call, as torch holds it across its own
 * allocator: a cache hit takes ~100 ns, and a backend call (cuMemAlloc) is
 * what torch.empty would make too. Pools whose alloc/free are Python
 * functions do not come here (their callbacks report errors through Python).
 *
 * A failure raises RuntimeError(text), where text is the structured value
 * every error crosses to Python as (bindings/pyerr: {"kind", "message",
 * "fields"} in JSON), as gopy's errors carry it; gpumempool._errors.translate
 * turns it into its own exception classes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

typedef uintptr_t (*gmp_py_alloc_fn)(int64_t handle, uint64_t size, int device, uintptr_t stream, char *buf,
                                     size_t n);
typedef int (*gmp_py_free_fn)(int64_t handle, uintptr_t ptr, char *buf, size_t n);
typedef int (*gmp_pickle_scan_fn)(const uint8_t *data, size_t n, int64_t max_depth, int64_t *ops, int64_t *pos,
                                  char *why, size_t why_len, uint64_t *nodes, int64_t *depth);

/* Room for an error value: an out-of-memory error's message and fields
 * take about 700 bytes; a longer message is shortened by Go, never the
 * JSON cut. */
#define GMP_ERROR_BUF 4096

static gmp_py_alloc_fn py_alloc;
static gmp_py_free_fn py_free;
static gmp_pickle_scan_fn pickle_scan;

/* bind(path): resolve the entry points in the loaded library at path. */
static PyObject *fast_bind(PyObject *self, PyObject *arg) {
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    /* RTLD_LAZY: the library was loaded lazily (it references NVML symbols
     * that resolve only once NVML is dlopened); RTLD_NOW would refuse it. */
    void *lib = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (lib == NULL) {
        const char *err = dlerror();
        PyErr_Format(PyExc_ImportError, "gpumempool._fastcall: %s is not loaded: %s", path, err ? err : "?");
        return NULL;
    }
    gmp_py_alloc_fn a = (gmp_py_alloc_fn)dlsym(lib, "gmp_py_alloc");
    gmp_py_free_fn f = (gmp_py_free_fn)dlsym(lib, "gmp_py_free");
    gmp_pickle_scan_fn s = (gmp_pickle_scan_fn)dlsym(lib, "gmp_pickle_scan");
    dlclose(lib); /* drops the reference NOLOAD added; Python's stays */
    if (a == NULL || f == NULL || s == NULL) {
        PyErr_Format(PyExc_ImportError, "gpumempool._fastcall: %s lacks gmp_py_alloc / gmp_py_free / gmp_pickle_scan",
                     path);
        return NULL;
    }
    py_alloc = a;
    py_free = f;
    pickle_scan = s;
    Py_RETURN_NONE;
}

/* 0 when a call may go ahead: the right number of arguments, and bind()
 * done; else an exception is set. */
static int cannot_call(Py_ssize_t nargs, Py_ssize_t want, const char *usage) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments (%zd given)", usage, want, nargs);
        return 1;
    }
    if (py_alloc == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "gpumempool._fastcall.bind() was not called");
        return 1;
    }
    return 0;
}

/* Raises the error value Go wrote into buf (or fallback, plain text, which
 * Python takes for a BackendError) and returns NULL.
 * Undecodable bytes (a pool name that is not valid UTF-8 ...) are replaced,
 * so the error raised is always this RuntimeError. */
static PyObject *failed(const char *buf, const char *fallback) {
    const char *text = buf[0] ? buf : fallback;
    PyObject *msg = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
    if (msg == NULL) return NULL;
    PyErr_SetObject(PyExc_RuntimeError, msg);
    Py_DECREF(msg);
    return NULL;
}

/* The integer args[i] as unsigned long long (Python ints only: a negative
 * or oversized one is an OverflowError); -1 with an exception set on error. */
static int ull_arg(PyObject *const *args, Py_ssize_t i, unsigned long long *out) {
    *out = PyLong_AsUnsignedLongLong(args[i]);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

/* alloc(handle, size, device, stream) -> address */
static PyObject *fast_alloc(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (cannot_call(nargs, 4, "alloc(handle, size, device, stream)")) return NULL;
    /* Each conversion is checked before the next: calling into Python
     * (__index__) with an exception pending is undefined. */
    long long handle = PyLong_AsLongLong(args[0]);
    if (handle == -1 && PyErr_Occurred()) return NULL;
    unsigned long long size, stream;
    if (ull_arg(args, 1, &size)) return NULL;
    long device = PyLong_AsLong(args[2]);
    if (device == -1 && PyErr_Occurred()) return NULL;
    if (ull_arg(args, 3, &stream)) return NULL;
    if (device < 0 || device > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "device %ld out of range", device);
        return NULL;
    }
    char buf[GMP_ERROR_BUF];
    buf[0] = 0;
    uintptr_t p = py_alloc((int64_t)handle, (uint64_t)size, (int)device, (uintptr_t)stream, buf, sizeof buf);
    if (p == 0) return failed(buf, "allocation failed");
    return PyLong_FromUnsignedLongLong((unsigned long long)p);
}

/* free(handle, address) -> None */
static PyObject *fast_free(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (cannot_call(nargs, 2, "free(handle, address)")) return NULL;
    long long handle = PyLong_AsLongLong(args[0]);
    if (handle == -1 && PyErr_Occurred()) return NULL;
    unsigned long long ptr;
    if (ull_arg(args, 1, &ptr)) return NULL;
    char buf[GMP_ERROR_BUF];
    buf[0] = 0;
    if (py_free((int64_t)handle, (uintptr_t)ptr, buf, sizeof buf) != 0) return failed(buf, "free failed");
    Py_RETURN_NONE;
}

/* scan_pickle(data, max_depth) -> (nodes, depth) | (truncated, why, ops, pos)
 *
 * Accepted: the bound on what the pickle builds (picklescan.Shape), nodes
 * None when there is none. Refused: why, and where.
 *
 * gmp_pickle_scan (internal/picklescan) over a bytes-like object, without
 * copying it and without the GIL: the buffer stays exported meanwhile, so a
 * bytearray cannot be resized under the scan. */
static PyObject *fast_scan_pickle(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (cannot_call(nargs, 2, "scan_pickle(data, max_depth)")) return NULL;
    long long max_depth = PyLong_AsLongLong(args[1]);
    if (max_depth == -1 && PyErr_Occurred()) return NULL;
    if (max_depth < 0 || max_depth > (1LL << 30)) {
        PyErr_Format(PyExc_ValueError, "max_depth %lld is not in [0, 2**30]", max_depth);
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) != 0) return NULL;
    int64_t ops = 0, pos = 0, depth = -1;
    uint64_t nodes = 0;
    char why[512];
    why[0] = 0;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = pickle_scan((const uint8_t *)view.buf, (size_t)view.len, (int64_t)max_depth, &ops, &pos, why, sizeof why,
                     &nodes, &depth);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    switch (rc) {
    case 0:
        if (depth < 0) return Py_BuildValue("(OL)", Py_None, (long long)-1);
        return Py_BuildValue("(KL)", (unsigned long long)nodes, (long long)depth);
    case 1:
    case 2:
        return Py_BuildValue("(NsLL)", PyBool_FromLong(rc == 2), why, (long long)ops, (long long)pos);
    default:
        return failed(why, "RuntimeError: the pickle scan failed");
    }
}

static PyMethodDef methods[] = {
    {"bind", fast_bind, METH_O, "bind(library_path): resolve gmp_py_alloc / gmp_py_free there."},
    {"alloc", (PyCFunction)(void (*)(void))fast_alloc, METH_FASTCALL,
     "alloc(handle, size, device, stream) -> address; RuntimeError(error value as JSON) on failure."},
    {"free", (PyCFunction)(void (*)(void))fast_free, METH_FASTCALL,
     "free(handle, address); RuntimeError(error value as JSON) on failure."},
    {"scan_pickle", (PyCFunction)(void (*)(void))fast_scan_pickle, METH_FASTCALL,
     "scan_pickle(data, max_depth) -> (nodes, depth) bounding what it builds (nodes None: no bound), or "
     "(truncated, why, ops, pos) for a pickle to refuse."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "gpumempool._fastcall", "MemPool.alloc / free without gopy's per-call cost.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__fastcall(void) { return PyModule_Create(&module); }
