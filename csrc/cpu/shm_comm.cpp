// (being written)
#include <torch/extension.h>
namespace swiftspec {
void register_shm_comm(pybind11::module_& m) {}
}  // namespace swiftspec
