// mirage's Python code that runs on the program's behalf (the torch.cuda functions it provides,
// its hooks, torch.utils.flop_counter's formulas in clocked mode) is not the program's: a GPU
// box has none of it. A Python profiler (torch.profiler's with_stack / Python tracer, cProfile:
// anything installed with sys.setprofile / PyEval_SetProfile) sees every Python frame, so such
// code runs with the calling thread's profile function taken off and put back after it. The
// profiler then sees what a GPU box shows there: a call of a built-in function (torch._C's are
// built-ins) or, inside an op, nothing. Why not filter afterwards: the profiler keeps no hook
// for that, and the frames would still have cost the program's profile their time.
#pragma once

#include <Python.h>

namespace mirage {

// This thread's Python profile function is off for the scope (the GIL held throughout).
class PythonProfilerSuspended {
 public:
  PythonProfilerSuspended();
  ~PythonProfilerSuspended();
  PythonProfilerSuspended(const PythonProfilerSuspended&) = delete;
  PythonProfilerSuspended& operator=(const PythonProfilerSuspended&) = delete;

 private:
  Py_tracefunc function_;
  PyObject* argument_;
};

// The GIL, for a C++ caller that may or may not hold it (an op runs without it).
class GilHeld {
 public:
  GilHeld() : state_(PyGILState_Ensure()) {}
  ~GilHeld() { PyGILState_Release(state_); }
  GilHeld(const GilHeld&) = delete;
  GilHeld& operator=(const GilHeld&) = delete;

 private:
  PyGILState_STATE state_;
};

}  // namespace mirage

extern "C" {
// A built-in function named `name` that calls `fn` unprofiled (new reference; NULL with a
// Python error set on failure). Called through ctypes.PyDLL (mirage/runtime/unprofiled.py).
PyObject* mirage_unprofiled(PyObject* fn, const char* name);
// A built-in function named `name` that calls `call` where the profiler sees it, with
// `before(*args, **kwargs)` unprofiled first and `after(what before returned, whether `call`
// returned)` unprofiled after it (also when `call` raises): a wrapper of the program's own work.
PyObject* mirage_unprofiled_around(PyObject* call, PyObject* before, PyObject* after, const char* name);
// Calls `callable(*args)` as the bottom of this thread's Python stack, as `python script.py`
// runs a script (exec of its code) or `python -m` runpy: the fork server's own frames beneath
// it are not on the stack a profiler, a memory snapshot, a traceback or sys._getframe walks (new
// reference, or NULL with the error set). CPython 3.11's frame chain: the first frame an
// evaluation pushes links to the thread's current frame.
PyObject* mirage_call_at_bottom(PyObject* callable, PyObject* args);
// Watches the session's connection `fd` from a thread of its own, which no Python profiler
// lists: once the far end closes it, calls `on_close()` (which ends the process), or, with
// the interpreter finalizing, writes `message` to stderr and exits with status 1.
void mirage_watch_connection(int fd, PyObject* on_close, const char* message);
}
