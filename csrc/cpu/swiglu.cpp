// (being written)
#include <torch/extension.h>
namespace swiftspec {
void register_swiglu(pybind11::module_& m) {}
}  // namespace swiftspec
