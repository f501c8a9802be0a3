// Python code of mirage's that no Python profiler sees (unprofiled.h).
#include "unprofiled.h"

#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <initializer_list>
#include <utility>

namespace mirage {

PythonProfilerSuspended::PythonProfilerSuspended() {
  PyThreadState* state = PyThreadState_Get();
  function_ = state->c_profilefunc;
  argument_ = state->c_profileobj;
  if (function_ == nullptr) return;
  Py_XINCREF(argument_);
  PyEval_SetProfile(nullptr, nullptr);
}

PythonProfilerSuspended::~PythonProfilerSuspended() {
  if (function_ == nullptr) return;
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);  // setting a profile function runs audit hooks: no error may be pending
  PyEval_SetProfile(function_, argument_);
  Py_XDECREF(argument_);
  PyErr_Restore(type, value, traceback);
}

}  // namespace mirage

namespace {

// The built-in's self: a module (so that it reads as "<built-in function NAME>", as torch._C's
// functions do) holding what it calls.
PyObject* held(PyObject* self, const char* what) { return PyDict_GetItemString(PyModule_GetDict(self), what); }

PyObject* call_unprofiled(PyObject* self, PyObject* args, PyObject* kwargs) {
  mirage::PythonProfilerSuspended suspended;
  return PyObject_Call(held(self, "fn"), args, kwargs);
}

PyObject* call_around(PyObject* self, PyObject* args, PyObject* kwargs) {
  PyObject* token;
  {
    mirage::PythonProfilerSuspended suspended;
    token = PyObject_Call(held(self, "before"), args, kwargs);
  }
  if (token == nullptr) return nullptr;
  PyObject* result = PyObject_Call(held(self, "call"), args, kwargs);
  PyObject *type, *value, *traceback;
  PyErr_Fetch(&type, &value, &traceback);
  PyObject* done;
  {
    mirage::PythonProfilerSuspended suspended;
    done = PyObject_CallFunctionObjArgs(held(self, "after"), token, result ? Py_True : Py_False, nullptr);
  }
  Py_DECREF(token);
  if (done == nullptr) {  // `after` failed: its error wins, as a finally clause's would
    Py_XDECREF(result);
    Py_XDECREF(type), Py_XDECREF(value), Py_XDECREF(traceback);
    return nullptr;
  }
  Py_DECREF(done);
  PyErr_Restore(type, value, traceback);
  return result;
}

// A built-in function `name` over `impl`, its self holding `held` (name -> object). The method
// table lives as long as the process: these wrap functions installed for its lifetime.
PyObject* builtin(const char* name, PyCFunctionWithKeywords impl,
                  std::initializer_list<std::pair<const char*, PyObject*>> objects) {
  PyObject* self = PyModule_New(name);
  if (self == nullptr) return nullptr;
  for (const auto& [key, object] : objects) {
    if (PyModule_AddObjectRef(self, key, object) < 0) {
      Py_DECREF(self);
      return nullptr;
    }
  }
  auto* method = new PyMethodDef{strdup(name), reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(impl)),
                                 METH_VARARGS | METH_KEYWORDS, nullptr};
  PyObject* function = PyCFunction_NewEx(method, self, nullptr);
  Py_DECREF(self);
  return function;
}

}  // namespace

extern "C" PyObject* mirage_unprofiled(PyObject* fn, const char* name) {
  return builtin(name, call_unprofiled, {{"fn", fn}});
}

extern "C" PyObject* mirage_unprofiled_around(PyObject* call, PyObject* before, PyObject* after, const char* name) {
  return builtin(name, call_around, {{"call", call}, {"before", before}, {"after", after}});
}

extern "C" PyObject* mirage_call_at_bottom(PyObject* callable, PyObject* args) {
#if PY_VERSION_HEX < 0x030D0000  // 3.11, 3.12: the chain hangs off the thread's C frame
  _PyCFrame* cframe = PyThreadState_Get()->cframe;
  _PyInterpreterFrame* beneath = cframe->current_frame;
  cframe->current_frame = nullptr;
  PyObject* result = PyObject_CallObject(callable, args);
  cframe->current_frame = beneath;
  return result;
#else  // 3.13 moved it to the thread state; not checked there yet: the caller's frames stay
  return PyObject_CallObject(callable, args);
#endif
}

extern "C" void mirage_watch_connection(int fd, PyObject* on_close, const char* message) {
  Py_INCREF(on_close);  // the thread's, for the life of the process
  std::thread([fd, on_close, text = std::string(message)] {
    char byte;
    for (;;) {  // the service never sends anything: only its end closing wakes this
      const ssize_t got = recv(fd, &byte, 1, 0);
      if (got == 0 || (got < 0 && errno != EINTR)) break;
    }
    if (!_Py_IsFinalizing()) {
      PyGILState_Ensure();
      PyObject_CallNoArgs(on_close);  // does not return
    }
    (void)!write(2, text.data(), text.size());
    _exit(1);
  }).detach();
}
