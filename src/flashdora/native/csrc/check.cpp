// A mixed-adapter layer's kept pack check in C++ (flashdora/peft/mixed.py, ``_unchanged``): the same comparisons as
// its Python passes, over the tuples ``_held`` keeps: a loop here costs less host time than those passes over
// objects rarely in the CPU's caches (docs/design.md, "Mixed-adapter batches"; docs/host-notes.md).

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

namespace {

namespace py = pybind11;

// Whether each held tensor is still its owner's "weight", with its version and address, and each held module still
// sits in its parent under its name, with its class and no instance "forward".
bool held_unchanged(const py::tuple& tensors, const py::tuple& owners, const py::tuple& versions, const py::tuple& ptrs,
                    const py::tuple& parents, const py::tuple& modules, const py::tuple& types,
                    const py::tuple& dicts) {
  static PyObject* weight = PyUnicode_InternFromString("weight");
  static PyObject* forward = PyUnicode_InternFromString("forward");
  const Py_ssize_t n = PyTuple_GET_SIZE(tensors.ptr()), m = PyTuple_GET_SIZE(modules.ptr());
  TORCH_CHECK(PyTuple_GET_SIZE(owners.ptr()) == n && PyTuple_GET_SIZE(versions.ptr()) == n &&
                  PyTuple_GET_SIZE(ptrs.ptr()) == n && PyTuple_GET_SIZE(parents.ptr()) == m &&
                  PyTuple_GET_SIZE(types.ptr()) == m && PyTuple_GET_SIZE(dicts.ptr()) == m,
              "held_unchanged: tuples of unequal lengths");
  bool same = true;
  for (Py_ssize_t i = 0; i < n && same; ++i) {
    PyObject* obj = PyTuple_GET_ITEM(tensors.ptr(), i);
    PyObject* owner = PyTuple_GET_ITEM(owners.ptr(), i);
    TORCH_CHECK(THPVariable_Check(obj) && PyDict_Check(owner), "held_unchanged: a tensor and its owner's dict");
    const at::Tensor& t = THPVariable_Unpack(obj);
    same = PyDict_GetItemWithError(owner, weight) == obj &&
           t._version() == PyLong_AsLongLong(PyTuple_GET_ITEM(versions.ptr(), i)) &&
           t.data_ptr() == PyLong_AsVoidPtr(PyTuple_GET_ITEM(ptrs.ptr(), i));
  }
  for (Py_ssize_t i = 0; i < m && same; ++i) {
    PyObject* module = PyTuple_GET_ITEM(modules.ptr(), i);
    PyObject* parent = PyTuple_GET_ITEM(parents.ptr(), i);
    PyObject* dict = PyTuple_GET_ITEM(dicts.ptr(), i);
    TORCH_CHECK(PyTuple_Check(parent) && PyTuple_GET_SIZE(parent) == 2 && PyDict_Check(PyTuple_GET_ITEM(parent, 0)) &&
                    PyDict_Check(dict),
                "held_unchanged: a module's (parent dict, name) and instance dict");
    same = reinterpret_cast<PyObject*>(Py_TYPE(module)) == PyTuple_GET_ITEM(types.ptr(), i) &&
           PyDict_GetItemWithError(PyTuple_GET_ITEM(parent, 0), PyTuple_GET_ITEM(parent, 1)) == module &&
           PyDict_Contains(dict, forward) == 0;
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  return same;
}

}  // namespace

namespace flashdora_native {

void add_check(pybind11::module_& m) {
  m.def("held_unchanged", &held_unchanged,
        "peft.mixed's kept-pack check: every held tensor and module as it was (tuples from peft.mixed._held)",
        py::arg("tensors"), py::arg("owners"), py::arg("versions"), py::arg("ptrs"), py::arg("parents"),
        py::arg("modules"), py::arg("types"), py::arg("dicts"));
}

}  // namespace flashdora_native
