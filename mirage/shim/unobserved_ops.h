// mirage's own operators (the mirage:: namespace: the shim's entry points for the runtime, the
// clock, capture checks, FLOP counts) are bookkeeping a GPU box does not have, so a user's
// torch.profiler, record_function nesting or any other RecordFunction observer must never see
// them. The dispatcher decides whether an operator is observed once, when its OperatorEntry is
// made from its schema (ObservedOperators: the list that keeps aten::size and the like out of
// profiles); so each mirage:: schema joins that list right before it is defined. Defining the
// operators through MIRAGE_LIBRARY(m) instead of TORCH_LIBRARY_FRAGMENT(mirage, m) does that.
#pragma once

#include <ATen/core/dispatch/ObservedOperators.h>
#include <torch/library.h>

#include <string>
#include <utility>

namespace mirage {

// torch::Library's def, for a mirage:: schema that no RecordFunction observer records.
class UnobservedOps {
 public:
  explicit UnobservedOps(torch::Library& lib) : lib_(lib) {}
  template <typename... Args>
  UnobservedOps& def(const char* schema, Args&&... args) {
    const std::string text(schema);
    c10::ObservedOperators::getUnobservedOperatorList().insert("mirage::" + text.substr(0, text.find('(')));
    lib_.def(schema, std::forward<Args>(args)...);
    return *this;
  }

 private:
  torch::Library& lib_;
};

}  // namespace mirage

#define MIRAGE_LIBRARY_IMPL(m, body)                            \
  static void body(mirage::UnobservedOps& m);                   \
  TORCH_LIBRARY_FRAGMENT(mirage, lib) {                         \
    mirage::UnobservedOps ops(lib);                             \
    body(ops);                                                  \
  }                                                             \
  static void body(mirage::UnobservedOps& m)
// A fragment of the mirage:: library whose operators are unobserved (see above).
#define MIRAGE_LIBRARY(m) MIRAGE_LIBRARY_IMPL(m, C10_CONCATENATE(mirage_library_, __LINE__))
