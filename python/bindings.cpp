// Python bindings of the CPU symmetric heap (tp_kernels._C). Plain pybind11, no libtorch: the
// Python side turns addresses and buffers into tensors itself.
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <string>
#include <system_error>

#include "shm_heap.h"

namespace py = pybind11;

namespace {

// A writable byte range of one rank's data region. It owns a reference to the heap, so a tensor
// made from it with torch.frombuffer keeps the mapping alive for as long as the tensor lives.
struct Region {
  std::shared_ptr<tpk::ShmHeap> heap;
  void* ptr;
  std::size_t size;
};

// Runs while a wait blocks with the GIL released: takes the GIL briefly to let Python deliver
// signals (Ctrl-C), and abandons the wait if a handler raised.
void check_python_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "tp_kernels native core: the CPU shared-memory symmetric heap";

  py::register_exception<tpk::SignalTimeout>(m, "SignalTimeoutError", PyExc_RuntimeError);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const std::system_error& e) {
      // OSError(errno, message), like the os module's own errors.
      py::object err = py::module_::import("builtins").attr("OSError")(e.code().value(), e.what());
      PyErr_SetObject(PyExc_OSError, err.ptr());
    }
  });

  m.def(
      "store_release",
      [](std::uintptr_t address, std::uint32_t value) {
        tpk::store_release(reinterpret_cast<std::uint32_t*>(address), value);
      },
      py::arg("address"), py::arg("value"),
      "Release store of the 32-bit word at address (memory of this process).");

  py::class_<Region>(m, "Region", py::buffer_protocol())
      .def_buffer([](Region& r) {
        return py::buffer_info(r.ptr, 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size)}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("address", [](const Region& r) {
        return reinterpret_cast<std::uintptr_t>(r.ptr);
      })
      .def("__len__", [](const Region& r) { return r.size; });

  py::class_<tpk::ShmHeap, std::shared_ptr<tpk::ShmHeap>>(m, "Heap", R"doc(
One allocation of the symmetric heap: a segment per rank of a group, mapped in this process.

Heap(group_name, rank, world_size, name_prefix, data_bytes, signal_words). Every rank builds one
with the same name_prefix, data_bytes and signal_words, then all run create(), a barrier,
map_peers(), a barrier, unlink(). Rank r's segment is named name_prefix + str(r).
)doc")
      .def(py::init<std::string, int, int, std::string, std::size_t, std::size_t>(),
           py::arg("group_name"), py::arg("rank"), py::arg("world_size"),
           py::arg("name_prefix"), py::arg("data_bytes"), py::arg("signal_words"))
      .def("create", &tpk::ShmHeap::create, "Create, size and map this rank's own segment.")
      .def("map_peers", &tpk::ShmHeap::map_peers, "Map every other rank's segment.")
      .def("unlink", &tpk::ShmHeap::unlink, "Remove this rank's segment name (idempotent).")
      .def_property_readonly("rank", &tpk::ShmHeap::rank)
      .def_property_readonly("world_size", &tpk::ShmHeap::world_size)
      .def_property_readonly("data_bytes", &tpk::ShmHeap::data_bytes)
      .def_property_readonly("signal_words", &tpk::ShmHeap::signal_words)
      .def_property_readonly("name_prefix", &tpk::ShmHeap::name_prefix)
      .def("segment_name", &tpk::ShmHeap::segment_name, py::arg("rank"))
      .def(
          "data_ptr",
          [](const tpk::ShmHeap& h, int rank) {
            return reinterpret_cast<std::uintptr_t>(h.data_ptr(rank));
          },
          py::arg("rank"), "Address of rank's data region in this process.")
      .def(
          "signal_pad_ptr",
          [](const tpk::ShmHeap& h, int rank) {
            return reinterpret_cast<std::uintptr_t>(h.signal_pad(rank));
          },
          py::arg("rank"), "Address of rank's signal pad (uint32 words) in this process.")
      .def(
          "data_region",
          [](const std::shared_ptr<tpk::ShmHeap>& h, int rank) {
            return Region{h, h->data_ptr(rank), h->data_bytes()};
          },
          py::arg("rank"), "rank's whole data region as a writable buffer.")
      .def(
          "put_signal",
          [](const tpk::ShmHeap& h, int dst_rank, std::size_t word, double timeout_s,
             const std::string& what) {
            py::gil_scoped_release nogil;
            h.put_signal(dst_rank, word, timeout_s, what, check_python_signals);
          },
          py::arg("dst_rank"), py::arg("word"), py::arg("timeout_s"), py::arg("what"),
          "Wait until word of dst_rank's pad is 0, then set it to 1 (release).")
      .def(
          "wait_signal",
          [](const tpk::ShmHeap& h, int src_rank, std::size_t word, double timeout_s,
             const std::string& what) {
            py::gil_scoped_release nogil;
            h.wait_signal(src_rank, word, timeout_s, what, check_python_signals);
          },
          py::arg("src_rank"), py::arg("word"), py::arg("timeout_s"), py::arg("what"),
          "Wait until word of this rank's pad is 1, then set it to 0 (acquire).")
      .def(
          "barrier",
          [](const tpk::ShmHeap& h, std::size_t channel, double timeout_s, const std::string& what) {
            py::gil_scoped_release nogil;
            h.barrier(channel, timeout_s, what, check_python_signals);
          },
          py::arg("channel"), py::arg("timeout_s"), py::arg("what"),
          "Signal every peer on channel, then wait for every peer's signal, within timeout_s.")
      .def("load_signal", &tpk::ShmHeap::load_signal, py::arg("rank"), py::arg("word"),
           "Acquire load of a word of rank's pad.");
}
