// bsattn._bsattn: the C++ API for Python. Tensors arrive as DLPack-capable objects (NumPy,
// PyTorch, CuPy, JAX) and become non-owning TensorViews; the Problem arrives as a dict of field
// values built by the Python layer (python/bsattn/_api.py), which owns all shape inference.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bsattn/bsattn.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using bsattn::Error;

// ---- Problem from a dict ------------------------------------------------------------------

template <class E>
E parse_enum(nb::handle value, const char* field, std::initializer_list<std::pair<std::string_view, E>> names) {
  const std::string name = nb::cast<std::string>(value);
  for (const auto& [n, e] : names)
    if (n == name) return e;
  throw Error(std::string("problem.") + field, "unknown value '" + name + "'");
}

bsattn::DType parse_dtype(nb::handle value, const char* field) {
  using bsattn::DType;
  return parse_enum<DType>(value, field, {{"f32", DType::f32}, {"f16", DType::f16}, {"bf16", DType::bf16}});
}

using FieldSetter = std::function<void(bsattn::Problem&, nb::handle)>;

template <class T, class Member>
FieldSetter set_number(Member member) {
  return [member](bsattn::Problem& p, nb::handle v) { member(p) = nb::cast<T>(v); };
}

const std::unordered_map<std::string_view, FieldSetter>& problem_fields() {
  using namespace bsattn;
  static const std::unordered_map<std::string_view, FieldSetter> fields = {
      {"batch", set_number<int>([](Problem& p) -> int& { return p.batch; })},
      {"heads_q", set_number<int>([](Problem& p) -> int& { return p.heads_q; })},
      {"heads_kv", set_number<int>([](Problem& p) -> int& { return p.heads_kv; })},
      {"head_dim", set_number<int>([](Problem& p) -> int& { return p.head_dim; })},
      {"max_seqlen_q", set_number<int>([](Problem& p) -> int& { return p.max_seqlen_q; })},
      {"max_seqlen_kv", set_number<int>([](Problem& p) -> int& { return p.max_seqlen_kv; })},
      {"total_q", set_number<std::int64_t>([](Problem& p) -> std::int64_t& { return p.total_q; })},
      {"total_kv", set_number<std::int64_t>([](Problem& p) -> std::int64_t& { return p.total_kv; })},
      {"page_size", set_number<int>([](Problem& p) -> int& { return p.page_size; })},
      {"num_pages", set_number<int>([](Problem& p) -> int& { return p.num_pages; })},
      {"pages_per_seq", set_number<int>([](Problem& p) -> int& { return p.pages_per_seq; })},
      {"block_q", set_number<int>([](Problem& p) -> int& { return p.block.q; })},
      {"block_kv", set_number<int>([](Problem& p) -> int& { return p.block.kv; })},
      {"sparsity_heads", set_number<int>([](Problem& p) -> int& { return p.sparsity_heads; })},
      {"sparsity_batch", set_number<int>([](Problem& p) -> int& { return p.sparsity_batch; })},
      {"has_partial", set_number<bool>([](Problem& p) -> bool& { return p.has_partial; })},
      {"has_full", set_number<bool>([](Problem& p) -> bool& { return p.has_full; })},
      {"causal", set_number<bool>([](Problem& p) -> bool& { return p.mask.causal; })},
      {"window_left", set_number<int>([](Problem& p) -> int& { return p.mask.window_left; })},
      {"window_right", set_number<int>([](Problem& p) -> int& { return p.mask.window_right; })},
      {"sink_tokens", set_number<int>([](Problem& p) -> int& { return p.mask.sink_tokens; })},
      {"document_ids", set_number<bool>([](Problem& p) -> bool& { return p.mask.document_ids; })},
      {"kv_valid_bits", set_number<bool>([](Problem& p) -> bool& { return p.mask.kv_valid_bits; })},
      {"scale", set_number<float>([](Problem& p) -> float& { return p.scale; })},
      {"device_index", set_number<int>([](Problem& p) -> int& { return p.device_index; })},
      {"max_routes_per_row", set_number<int>([](Problem& p) -> int& { return p.max_routes_per_row; })},
      {"tile_m", set_number<int>([](Problem& p) -> int& { return p.tile_m; })},
      {"tile_n", set_number<int>([](Problem& p) -> int& { return p.tile_n; })},
      {"num_threads", set_number<int>([](Problem& p) -> int& { return p.num_threads; })},
      {"validate", set_number<bool>([](Problem& p) -> bool& { return p.validate; })},
      {"backward", set_number<bool>([](Problem& p) -> bool& { return p.backward; })},
      {"dtype", [](Problem& p, nb::handle v) { p.dtype = parse_dtype(v, "dtype"); }},
      {"out_dtype", [](Problem& p, nb::handle v) { p.out_dtype = parse_dtype(v, "out_dtype"); }},
      {"q_layout",
       [](Problem& p, nb::handle v) {
         p.q_layout = parse_enum<QLayout>(v, "q_layout", {{"batched", QLayout::batched}, {"varlen", QLayout::varlen}});
       }},
      {"kv_layout",
       [](Problem& p, nb::handle v) {
         p.kv_layout =
             parse_enum<KVLayout>(v, "kv_layout", {{"contiguous", KVLayout::contiguous}, {"paged", KVLayout::paged}});
       }},
      {"format",
       [](Problem& p, nb::handle v) {
         p.format = parse_enum<Format>(v, "format",
                                       {{"all_blocks", Format::all_blocks},
                                        {"block_lists", Format::block_lists},
                                        {"varlen_block_lists", Format::varlen_block_lists},
                                        {"bsr", Format::bsr},
                                        {"bitmask", Format::bitmask}});
       }},
      {"alignment",
       [](Problem& p, nb::handle v) {
         p.mask.alignment = parse_enum<Alignment>(
             v, "alignment", {{"bottom_right", Alignment::bottom_right}, {"top_left", Alignment::top_left}});
       }},
      {"proxy",
       [](Problem& p, nb::handle v) {
         p.proxy = parse_enum<Proxy>(
             v, "proxy", {{"off", Proxy::off}, {"eligible", Proxy::eligible}, {"explicit_set", Proxy::explicit_set}});
       }},
      {"device",
       [](Problem& p, nb::handle v) {
         p.device = parse_enum<Device>(v, "device", {{"cpu", Device::cpu}, {"cuda", Device::cuda}});
       }},
  };
  return fields;
}

bsattn::Problem problem_from_dict(const nb::dict& values) {
  bsattn::Problem problem;
  for (auto [key, value] : values) {
    const std::string name = nb::cast<std::string>(key);
    const auto& fields = problem_fields();
    const auto field = fields.find(name);
    if (field == fields.end()) throw Error("problem", "unknown field '" + name + "'");
    try {
      field->second(problem, value);
    } catch (const nb::cast_error&) {
      throw Error("problem." + name, "wrong value type");
    }
  }
  return problem;
}

// ---- Tensors ------------------------------------------------------------------------------

using ReadArray = nb::ndarray<nb::ro>;  // inputs: read-only sources accepted
using WriteArray = nb::ndarray<>;       // outputs: read-only sources refused

bsattn::DType dtype_of(const nb::dlpack::dtype& t, const std::string& name) {
  using Code = nb::dlpack::dtype_code;
  const auto code = static_cast<Code>(t.code);
  if (t.lanes == 1) {
    if (code == Code::Float && t.bits == 32) return bsattn::DType::f32;
    if (code == Code::Float && t.bits == 16) return bsattn::DType::f16;
    if (code == Code::Bfloat && t.bits == 16) return bsattn::DType::bf16;
    if (code == Code::Int && t.bits == 32) return bsattn::DType::i32;
    if (code == Code::UInt && t.bits == 32) return bsattn::DType::u32;
  }
  throw Error(name, "unsupported dtype (DLPack code " + std::to_string(t.code) + ", " + std::to_string(t.bits) +
                        " bits); expected float32, float16, bfloat16, int32 or uint32");
}

bsattn::DType reinterpreted(const std::string& type, const nb::dlpack::dtype& t, const std::string& name) {
  bsattn::DType dtype;
  if (type == "bf16") dtype = bsattn::DType::bf16;
  else if (type == "u32") dtype = bsattn::DType::u32;
  else throw Error(name, "unknown reinterpretation '" + type + "'");
  if (t.lanes != 1 || t.bits != 8 * bsattn::element_size(dtype))
    throw Error(name, "cannot reinterpret " + std::to_string(t.bits) + "-bit elements as " + type);
  return dtype;
}

bsattn::Stream to_stream(std::uintptr_t stream) { return reinterpret_cast<bsattn::Stream>(stream); }

// A zero-size tensor is still an argument that was given (an empty BSR, an empty varlen batch),
// but producers may hand it over with a null pointer (TensorView::empty_address()).
void set_data(bsattn::TensorView& t, const void* data) {
  t.data = data == nullptr && t.numel() == 0 ? bsattn::TensorView::empty_address() : const_cast<void*>(data);
}

// Everything one call reads or writes. The arrays keep their producers alive while the GIL is
// released.
struct Bound {
  std::vector<ReadArray> read;
  std::vector<WriteArray> written;
  bsattn::Inputs inputs;
  bsattn::Outputs outputs;

  // A tensor argument is a DLPack-capable object (or capsule), or (object, dtype name) to
  // reinterpret its elements as a type of the same size: NumPy bfloat16 travels as uint16,
  // PyTorch bit words as int32.
  template <class Array>
  bsattn::TensorView view(nb::handle object, const std::string& name, std::vector<Array>& keep) {
    nb::handle source = object;
    std::string reinterpret;
    if (nb::isinstance<nb::tuple>(object)) {
      const nb::tuple pair = nb::borrow<nb::tuple>(object);
      if (pair.size() != 2) throw Error(name, "expected a tensor or a (tensor, dtype) pair");
      source = pair[0];
      reinterpret = nb::cast<std::string>(pair[1]);
    }
    Array a;
    if (!nb::try_cast(source, a)) {
      constexpr bool writable = std::is_same_v<Array, WriteArray>;
      const std::string expected = writable ? "expected a writable DLPack tensor" : "expected a DLPack tensor";
      throw Error(name, expected + ", got " + nb::inst_name(source).c_str());
    }
    bsattn::TensorView t;
    if (a.ndim() > static_cast<std::size_t>(bsattn::TensorView::kMaxRank))
      throw Error(name, "rank " + std::to_string(a.ndim()) + " exceeds 5");
    t.dtype = reinterpret.empty() ? dtype_of(a.dtype(), name) : reinterpreted(reinterpret, a.dtype(), name);
    if (a.device_type() == nb::device::cpu::value) t.device = bsattn::Device::cpu;
    else if (a.device_type() == nb::device::cuda::value) t.device = bsattn::Device::cuda;
    else throw Error(name, "unsupported device (DLPack device type " + std::to_string(a.device_type()) + ")");
    t.device_index = a.device_id();
    t.rank = static_cast<int>(a.ndim());
    for (int i = 0; i < t.rank; ++i) {
      t.shape[i] = static_cast<std::int64_t>(a.shape(i));
      t.stride[i] = a.stride(i);
    }
    set_data(t, a.data());
    keep.push_back(std::move(a));
    return t;
  }
  bsattn::TensorView input(nb::handle object, const std::string& name) { return view(object, name, read); }
  bsattn::TensorView output(nb::handle object, const std::string& name) { return view(object, name, written); }
};

using InputSlot = bsattn::TensorView& (*)(bsattn::Inputs&);

const std::unordered_map<std::string_view, InputSlot>& input_slots() {
  using bsattn::Inputs;
  using bsattn::TensorView;
  static const std::unordered_map<std::string_view, InputSlot> slots = {
      {"q", [](Inputs& in) -> TensorView& { return in.q; }},
      {"k", [](Inputs& in) -> TensorView& { return in.k; }},
      {"v", [](Inputs& in) -> TensorView& { return in.v; }},
      {"cu_seqlens_q", [](Inputs& in) -> TensorView& { return in.cu_seqlens_q; }},
      {"cu_seqlens_k", [](Inputs& in) -> TensorView& { return in.cu_seqlens_k; }},
      {"seqused_k", [](Inputs& in) -> TensorView& { return in.seqused_k; }},
      {"block_table", [](Inputs& in) -> TensorView& { return in.block_table; }},
      {"seq_lens_kv", [](Inputs& in) -> TensorView& { return in.seq_lens_kv; }},
      {"partial.counts", [](Inputs& in) -> TensorView& { return in.partial.counts; }},
      {"partial.indices", [](Inputs& in) -> TensorView& { return in.partial.indices; }},
      {"partial.indptr", [](Inputs& in) -> TensorView& { return in.partial.indptr; }},
      {"partial.bits", [](Inputs& in) -> TensorView& { return in.partial.bits; }},
      {"full.counts", [](Inputs& in) -> TensorView& { return in.full.counts; }},
      {"full.indices", [](Inputs& in) -> TensorView& { return in.full.indices; }},
      {"full.indptr", [](Inputs& in) -> TensorView& { return in.full.indptr; }},
      {"full.bits", [](Inputs& in) -> TensorView& { return in.full.bits; }},
      {"proxy.counts", [](Inputs& in) -> TensorView& { return in.proxy.counts; }},
      {"proxy.indices", [](Inputs& in) -> TensorView& { return in.proxy.indices; }},
      {"proxy.indptr", [](Inputs& in) -> TensorView& { return in.proxy.indptr; }},
      {"proxy.bits", [](Inputs& in) -> TensorView& { return in.proxy.bits; }},
      {"cu_total_m_blocks", [](Inputs& in) -> TensorView& { return in.cu_total_m_blocks; }},
      {"cu_block_idx_offsets", [](Inputs& in) -> TensorView& { return in.cu_block_idx_offsets; }},
      {"doc_q", [](Inputs& in) -> TensorView& { return in.doc_q; }},
      {"doc_kv", [](Inputs& in) -> TensorView& { return in.doc_kv; }},
      {"kv_valid", [](Inputs& in) -> TensorView& { return in.kv_valid; }},
      {"k_summary", [](Inputs& in) -> TensorView& { return in.k_summary; }},
      {"v_summary", [](Inputs& in) -> TensorView& { return in.v_summary; }},
  };
  return slots;
}

// inputs: slot name -> tensor (None: not given); outputs: "out" / "lse" -> tensor.
void bind_call(Bound& bound, const nb::dict& inputs, const nb::dict& outputs) {
  for (auto [key, value] : inputs) {
    if (value.is_none()) continue;
    const std::string name = nb::cast<std::string>(key);
    const auto slot = input_slots().find(name);
    if (slot == input_slots().end()) throw Error("inputs", "unknown tensor '" + name + "'");
    slot->second(bound.inputs) = bound.input(value, name);
  }
  for (auto [key, value] : outputs) {
    if (value.is_none()) continue;
    const std::string name = nb::cast<std::string>(key);
    if (name == "out") bound.outputs.out = bound.output(value, "outputs.out");
    else if (name == "lse") bound.outputs.lse = bound.output(value, "outputs.lse");
    else throw Error("outputs", "unknown tensor '" + name + "'");
  }
}

// The tensor layout of one call signature (shapes, strides, dtypes, devices), bound once from
// DLPack; later calls of the same signature (python/bsattn/torch_ops.py caches one per signature)
// give only the data pointers, so a repeated call makes no DLPack capsule and reads no dict.
// Pointers come in the order of the non-None entries of the constructor's dicts, inputs first.
// run() rewrites the stored views: callers serialise it, as they must the plan it runs.
class CallLayout {
 public:
  CallLayout(const nb::dict& inputs, const nb::dict& outputs) {
    Bound bound;
    bind_call(bound, inputs, outputs);
    inputs_ = bound.inputs;
    outputs_ = bound.outputs;
    for (auto [key, value] : inputs)
      if (!value.is_none()) views_.push_back(&input_slots().at(nb::cast<std::string>(key))(inputs_));
    for (auto [key, value] : outputs)
      if (!value.is_none()) views_.push_back(nb::cast<std::string>(key) == "out" ? &outputs_.out : &outputs_.lse);
  }
  CallLayout(const CallLayout&) = delete;
  CallLayout& operator=(const CallLayout&) = delete;

  void run(bsattn::Plan& plan, const nb::list& pointers, std::uintptr_t stream) {
    if (pointers.size() != views_.size())
      throw Error("pointers", std::to_string(pointers.size()) + " data pointers for a layout of " +
                                  std::to_string(views_.size()) + " tensors");
    for (std::size_t i = 0; i < views_.size(); ++i) {
      void* data = PyLong_AsVoidPtr(pointers[i].ptr());
      if (data == nullptr && PyErr_Occurred()) throw nb::python_error();
      set_data(*views_[i], data);
    }
    nb::gil_scoped_release unlocked;
    plan.run(inputs_, outputs_, to_stream(stream));
  }

 private:
  bsattn::Inputs inputs_;
  bsattn::Outputs outputs_;
  std::vector<bsattn::TensorView*> views_;
};

struct BackwardCall {
  bsattn::BackwardInputs backward;
  bsattn::Gradients gradients;
};

// backward: "out" / "lse" / "dout" / "dlse" (None: not given); gradients: "dq" / "dk" / "dv".
BackwardCall bind_backward(Bound& bound, const nb::dict& backward, const nb::dict& gradients) {
  BackwardCall c;
  c.backward.out = bound.input(backward["out"], "backward.out");
  c.backward.lse = bound.input(backward["lse"], "backward.lse");
  c.backward.dout = bound.input(backward["dout"], "backward.dout");
  if (!backward["dlse"].is_none()) c.backward.dlse = bound.input(backward["dlse"], "backward.dlse");
  c.gradients.dq = bound.output(gradients["dq"], "gradients.dq");
  c.gradients.dk = bound.output(gradients["dk"], "gradients.dk");
  c.gradients.dv = bound.output(gradients["dv"], "gradients.dv");
  return c;
}

// select_blocks() options from a dict built by python/bsattn/_select.py.
bsattn::SelectOptions select_options_from_dict(const nb::dict& values) {
  using namespace bsattn;
  SelectOptions o;
  for (auto [key, value] : values) {
    const std::string name = nb::cast<std::string>(key);
    const std::string argument = "options." + name;
    try {
      if (name == "policy")
        o.policy = parse_enum<SelectPolicy>(
            value, "policy", {{"top_k", SelectPolicy::top_k}, {"tau", SelectPolicy::tau}, {"mass", SelectPolicy::mass}});
      else if (name == "top_k") o.top_k = nb::cast<int>(value);
      else if (name == "tau") o.tau = nb::cast<float>(value);
      else if (name == "mass") o.mass = nb::cast<float>(value);
      else if (name == "sinks") o.sinks = nb::cast<int>(value);
      else if (name == "local") o.local = nb::cast<int>(value);
      else if (name == "diagonal") o.diagonal = nb::cast<bool>(value);
      else if (name == "causal") o.causal = nb::cast<bool>(value);
      else if (name == "alignment")
        o.alignment = parse_enum<Alignment>(value, "alignment",
                                            {{"bottom_right", Alignment::bottom_right}, {"top_left", Alignment::top_left}});
      else if (name == "heads")
        o.heads = parse_enum<SelectHeads>(value, "heads", {{"q", SelectHeads::query}, {"kv", SelectHeads::kv}});
      else throw Error("options", "unknown field '" + name + "'");
    } catch (const nb::cast_error&) {
      throw Error(argument, "wrong value type");
    }
  }
  return o;
}

nb::dict tiles_dict(const bsattn::TileShape& t) {
  nb::dict d;
  d["tile_m"] = t.tile_m;
  d["tile_n"] = t.tile_n;
  d["unit_m"] = t.unit_m;
  d["units_per_tile"] = t.units_per_tile;
  d["kv_split"] = t.kv_split;
  d["packed_heads"] = t.packed_heads;  // the GPU decode kernel (0: prefill kernels)
  d["kv_splits"] = t.kv_splits;
  return d;
}

}  // namespace

NB_MODULE(_bsattn, m) {
  m.doc() = "bsattn C++ API (use the bsattn package, not this module directly)";
#if BSATTN_WITH_CUDA
  m.attr("built_with_cuda") = true;
#else
  m.attr("built_with_cuda") = false;
#endif

  // bsattn::Error -> BsattnError(ValueError) with the library's message and its `argument`.
  static PyObject* error_type =
      PyErr_NewExceptionWithDoc("bsattn.BsattnError", "An input bsattn rejected; `argument` names it.",
                                PyExc_ValueError, nullptr);
  m.attr("BsattnError") = nb::handle(error_type);
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      nb::object error = nb::handle(error_type)(e.what());
      error.attr("argument") = e.argument();
      PyErr_SetObject(error_type, error.ptr());
    }
  });

  nb::class_<bsattn::Plan>(m, "Plan")
      .def(nb::init<>())
      .def("plan", [](bsattn::Plan& plan, const nb::dict& problem) { plan.plan(problem_from_dict(problem)); },
           "problem"_a)
      .def(
          "run",
          [](bsattn::Plan& plan, const nb::dict& inputs, const nb::dict& outputs, std::uintptr_t stream) {
            Bound bound;
            bind_call(bound, inputs, outputs);
            nb::gil_scoped_release unlocked;
            plan.run(bound.inputs, bound.outputs, to_stream(stream));
          },
          "inputs"_a, "outputs"_a, "stream"_a = 0)
      .def(
          "run_backward",
          [](bsattn::Plan& plan, const nb::dict& inputs, const nb::dict& backward, const nb::dict& gradients,
             std::uintptr_t stream) {
            Bound bound;
            bind_call(bound, inputs, nb::dict());
            const BackwardCall call = bind_backward(bound, backward, gradients);
            nb::gil_scoped_release unlocked;
            plan.run_backward(bound.inputs, call.backward, call.gradients, to_stream(stream));
          },
          "inputs"_a, "backward"_a, "gradients"_a, "stream"_a = 0)
      .def_prop_ro("planned", &bsattn::Plan::planned)
      .def_prop_ro("tiles", [](const bsattn::Plan& plan) { return tiles_dict(plan.tiles()); })
      .def_prop_ro("route_capacity", &bsattn::Plan::route_capacity)
      .def_prop_ro("workspace_bytes", &bsattn::Plan::workspace_bytes);

  // Summaries -> select -> attend in one run (python/bsattn/_selected.py builds both dicts).
  nb::class_<bsattn::SelectedAttention>(m, "SelectedAttention")
      .def(
          "__init__",
          [](bsattn::SelectedAttention* self, const nb::dict& problem, const nb::dict& options) {
            new (self) bsattn::SelectedAttention(problem_from_dict(problem), select_options_from_dict(options));
          },
          "problem"_a, "options"_a)
      .def(
          "run",
          [](bsattn::SelectedAttention& selected, const nb::dict& inputs, const nb::dict& outputs,
             std::uintptr_t stream) {
            Bound bound;
            bind_call(bound, inputs, outputs);
            nb::gil_scoped_release unlocked;
            selected.run(bound.inputs, bound.outputs, to_stream(stream));
          },
          "inputs"_a, "outputs"_a, "stream"_a = 0)
      .def_prop_ro("workspace_bytes", &bsattn::SelectedAttention::workspace_bytes);

  nb::class_<CallLayout>(m, "CallLayout")
      .def(nb::init<const nb::dict&, const nb::dict&>(), "inputs"_a, "outputs"_a)
      .def("run", &CallLayout::run, "plan"_a, "pointers"_a, "stream"_a = 0);

  m.def(
      "attention",
      [](const nb::dict& problem, const nb::dict& inputs, const nb::dict& outputs, std::uintptr_t stream) {
        const bsattn::Problem p = problem_from_dict(problem);
        Bound bound;
        bind_call(bound, inputs, outputs);
        nb::gil_scoped_release unlocked;
        bsattn::attention(p, bound.inputs, bound.outputs, to_stream(stream));
      },
      "problem"_a, "inputs"_a, "outputs"_a, "stream"_a = 0);

  m.def(
      "attention_backward",
      [](const nb::dict& problem, const nb::dict& inputs, const nb::dict& backward, const nb::dict& gradients,
         std::uintptr_t stream) {
        const bsattn::Problem p = problem_from_dict(problem);
        Bound bound;
        bind_call(bound, inputs, nb::dict());
        const BackwardCall call = bind_backward(bound, backward, gradients);
        nb::gil_scoped_release unlocked;
        bsattn::attention_backward(p, bound.inputs, call.backward, call.gradients, to_stream(stream));
      },
      "problem"_a, "inputs"_a, "backward"_a, "gradients"_a, "stream"_a = 0);

  m.def(
      "build_summaries",
      [](const nb::dict& problem, const nb::dict& inputs, nb::handle k_summary, nb::handle v_summary,
         std::uintptr_t stream) {
        const bsattn::Problem p = problem_from_dict(problem);
        Bound bound;
        bind_call(bound, inputs, nb::dict());
        const bsattn::TensorView ks = bound.output(k_summary, "k_summary");
        const bsattn::TensorView vs = bound.output(v_summary, "v_summary");
        nb::gil_scoped_release unlocked;
        bsattn::build_summaries(p, bound.inputs, ks, vs, to_stream(stream));
      },
      "problem"_a, "inputs"_a, "k_summary"_a, "v_summary"_a, "stream"_a = 0);

  m.def(
      "varlen_block_offsets",
      [](const nb::dict& problem, const nb::dict& inputs, nb::handle cu_total_m_blocks,
         nb::handle cu_block_idx_offsets, std::uintptr_t stream) {
        const bsattn::Problem p = problem_from_dict(problem);
        Bound bound;
        bind_call(bound, inputs, nb::dict());
        const bsattn::TensorView m_blocks = bound.output(cu_total_m_blocks, "cu_total_m_blocks");
        const bsattn::TensorView offsets = bound.output(cu_block_idx_offsets, "cu_block_idx_offsets");
        nb::gil_scoped_release unlocked;
        bsattn::varlen_block_offsets(p, bound.inputs, m_blocks, offsets, to_stream(stream));
      },
      "problem"_a, "inputs"_a, "cu_total_m_blocks"_a, "cu_block_idx_offsets"_a, "stream"_a = 0);

  m.def(
      "select_blocks",
      [](const nb::dict& problem, const nb::dict& inputs, const nb::dict& options, nb::handle bits,
         std::uintptr_t stream) {
        const bsattn::Problem p = problem_from_dict(problem);
        const bsattn::SelectOptions o = select_options_from_dict(options);
        Bound bound;
        bind_call(bound, inputs, nb::dict());
        const bsattn::TensorView words = bound.output(bits, "bits");
        nb::gil_scoped_release unlocked;
        bsattn::select_blocks(p, bound.inputs, o, words, to_stream(stream));
      },
      "problem"_a, "inputs"_a, "options"_a, "bits"_a, "stream"_a = 0);

  // merge_state: the parts (out_a, lse_a), (out_b, lse_b); merge_states: outs, lses stacked [N, ...].
  // `lse` may be None (only O is written).
  m.def(
      "merge_state",
      [](nb::handle out_a, nb::handle lse_a, nb::handle out_b, nb::handle lse_b, nb::handle out, nb::handle lse,
         std::uintptr_t stream) {
        Bound bound;
        const bsattn::TensorView a = bound.input(out_a, "out_a"), la = bound.input(lse_a, "lse_a");
        const bsattn::TensorView b = bound.input(out_b, "out_b"), lb = bound.input(lse_b, "lse_b");
        const bsattn::TensorView o = bound.output(out, "out");
        const bsattn::TensorView l = lse.is_none() ? bsattn::TensorView{} : bound.output(lse, "lse");
        nb::gil_scoped_release unlocked;
        bsattn::merge_state(a, la, b, lb, o, l, to_stream(stream));
      },
      "out_a"_a, "lse_a"_a, "out_b"_a, "lse_b"_a, "out"_a, "lse"_a.none(), "stream"_a = 0);
  m.def(
      "merge_states",
      [](nb::handle outs, nb::handle lses, nb::handle out, nb::handle lse, std::uintptr_t stream) {
        Bound bound;
        const bsattn::TensorView os = bound.input(outs, "outs"), ls = bound.input(lses, "lses");
        const bsattn::TensorView o = bound.output(out, "out");
        const bsattn::TensorView l = lse.is_none() ? bsattn::TensorView{} : bound.output(lse, "lse");
        nb::gil_scoped_release unlocked;
        bsattn::merge_states(os, ls, o, l, to_stream(stream));
      },
      "outs"_a, "lses"_a, "out"_a, "lse"_a.none(), "stream"_a = 0);
}
