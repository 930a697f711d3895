// (being written)
#include <torch/extension.h>
namespace swiftspec {
void register_tree_attention(pybind11::module_& m) {}
}  // namespace swiftspec
