#include "config.hpp"

#include <fstream>
#include <initializer_list>
#include <nlohmann/json.hpp>
#include <sstream>

namespace bsattn::tools {
namespace {

using json = nlohmann::json;

// Reads one JSON object, rejecting unknown keys (a misspelt option must not be ignored).
class Reader {
 public:
  Reader(const json& j, std::string path, std::initializer_list<const char*> keys) : j_(j), path_(std::move(path)) {
    if (!j_.is_object()) fail(path_.empty() ? "the config must be a JSON object" : path_ + " must be an object");
    for (const auto& item : j_.items()) {
      bool known = false;
      for (const char* k : keys) known = known || item.key() == k;
      if (!known) fail("unknown key " + where(item.key()));
    }
  }

  bool has(const char* key) const { return j_.contains(key); }
  const json& at(const char* key) const { return j_.at(key); }
  std::string where(const std::string& key) const { return "'" + (path_.empty() ? key : path_ + "." + key) + "'"; }
  [[noreturn]] static void fail(const std::string& message) { throw SpecError("config: " + message); }

  template <class T>
  T get(const char* key, T fallback) const {
    if (!has(key)) return fallback;
    try {
      return j_.at(key).get<T>();
    } catch (const json::exception&) {
      fail(where(key) + " has the wrong type");
    }
  }
  int get_int(const char* key, int fallback) const {
    if (has(key) && !j_.at(key).is_number_integer()) fail(where(key) + " must be an integer");
    return get<int>(key, fallback);
  }
  std::vector<int> get_ints(const char* key) const {
    if (!j_.at(key).is_array()) fail(where(key) + " must be an array of integers");
    return get<std::vector<int>>(key, {});
  }
  // One of `names`, returned as its index.
  int choice(const char* key, std::initializer_list<const char*> names, int fallback) const {
    if (!has(key)) return fallback;
    const std::string v = get<std::string>(key, "");
    int i = 0;
    std::string all;
    for (const char* n : names) {
      if (v == n) return i;
      all += (i++ ? ", " : "") + std::string(n);
    }
    fail(where(key) + " is '" + v + "'; expected one of " + all);
  }

 private:
  const json& j_;
  std::string path_;
};

DType dtype_of(const Reader& r, const char* key, DType fallback) {
  if (!r.has(key)) return fallback;
  static const DType types[] = {DType::f32, DType::f16, DType::bf16};
  return types[r.choice(key, {"f32", "f16", "bf16"}, 0)];
}

void read_mask(const json& j, MaskOptions& m) {
  const Reader r(j, "mask", {"causal", "alignment", "window_left", "window_right", "sink_tokens", "documents"});
  m.causal = r.get<bool>("causal", false);
  m.alignment = r.choice("alignment", {"bottom_right", "top_left"}, 0) ? Alignment::top_left : Alignment::bottom_right;
  m.window_left = r.get_int("window_left", -1);
  m.window_right = r.get_int("window_right", -1);
  m.sink_tokens = r.get_int("sink_tokens", 0);
  if (r.has("documents")) m.document_lengths = r.get_ints("documents");
}

void read_pattern(const json& j, PatternOptions& p) {
  const Reader r(j, "pattern", {"mask_blocks", "random_density", "random_full", "blocks"});
  p.mask_blocks = r.get<bool>("mask_blocks", true);
  p.random_density = r.get<double>("random_density", 0.0);
  p.random_full = r.get<bool>("random_full", false);
  if (!r.has("blocks")) return;
  if (!r.at("blocks").is_array()) Reader::fail(r.where("blocks") + " must be an array of [q_block, kv_block(, \"full\")]");
  for (const json& b : r.at("blocks")) {
    const bool shaped = b.is_array() && (b.size() == 2 || b.size() == 3) && b[0].is_number_integer() &&
                        b[1].is_number_integer() && (b.size() == 2 || b[2] == "full" || b[2] == "partial");
    if (!shaped) Reader::fail("pattern.blocks entry " + b.dump() + " is not [q_block, kv_block] or [q_block, kv_block, \"full\"]");
    p.blocks.push_back({b[0].get<int>(), b[1].get<int>(), b.size() == 3 && b[2] == "full"});
  }
}

}  // namespace

RunConfig parse_run_config(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    Reader::fail(std::string("not valid JSON: ") + e.what());
  }
  const Reader r(j, "", {"batch", "heads_q", "heads_kv", "head_dim", "layout", "seqlen_q", "seqlen_kv", "seqlens_q",
                         "seqlens_kv", "kv_layout", "page_size", "dtype", "out_dtype", "block", "format",
                         "sparsity_heads", "mask", "pattern", "proxy", "scale", "seed", "repeats", "warmup", "device",
                         "threads", "verify", "dense_baseline"});
  RunConfig c;
  WorkloadSpec& s = c.spec;
  s.heads_q = r.get_int("heads_q", s.heads_q);
  s.heads_kv = r.get_int("heads_kv", s.heads_kv);
  s.head_dim = r.get_int("head_dim", s.head_dim);
  s.q_layout = r.choice("layout", {"batched", "varlen"}, 0) ? QLayout::varlen : QLayout::batched;
  if (s.q_layout == QLayout::varlen) {
    if (!r.has("seqlens_q")) Reader::fail("the varlen layout needs 'seqlens_q' (one length per sequence)");
    if (r.has("seqlen_q") || r.has("seqlen_kv")) Reader::fail("the varlen layout takes 'seqlens_q' / 'seqlens_kv' lists");
    s.seqlens_q = r.get_ints("seqlens_q");
    s.seqlens_kv = r.has("seqlens_kv") ? r.get_ints("seqlens_kv") : s.seqlens_q;
    s.batch = r.get_int("batch", static_cast<int>(s.seqlens_q.size()));
  } else {
    if (r.has("seqlens_q") || r.has("seqlens_kv")) Reader::fail("the batched layout takes 'seqlen_q' / 'seqlen_kv'");
    s.batch = r.get_int("batch", 1);
    const int sq = r.get_int("seqlen_q", 4096);
    s.seqlens_q.assign(std::max(0, s.batch), sq);
    s.seqlens_kv.assign(std::max(0, s.batch), r.get_int("seqlen_kv", sq));
  }
  s.kv_layout = r.choice("kv_layout", {"contiguous", "paged"}, 0) ? KVLayout::paged : KVLayout::contiguous;
  s.page_size = r.get_int("page_size", s.page_size);
  s.dtype = dtype_of(r, "dtype", DType::bf16);
  s.out_dtype = dtype_of(r, "out_dtype", s.dtype);
  if (r.has("block")) {
    const json& b = r.at("block");
    if (b.is_number_integer()) s.block = {b.get<int>(), b.get<int>()};
    else if (b.is_array() && b.size() == 2 && b[0].is_number_integer() && b[1].is_number_integer())
      s.block = {b[0].get<int>(), b[1].get<int>()};
    else Reader::fail("'block' must be an integer or [block_q, block_kv]");
  }
  static const Format formats[] = {Format::all_blocks, Format::block_lists, Format::varlen_block_lists, Format::bsr,
                                   Format::bitmask};
  const int default_format = s.q_layout == QLayout::varlen ? 2 : 1;
  s.format = formats[r.choice("format", {"all_blocks", "block_lists", "varlen_block_lists", "bsr", "bitmask"}, default_format)];
  s.sparsity_heads = r.get_int("sparsity_heads", 1);
  if (r.has("mask")) read_mask(r.at("mask"), s.mask);
  if (r.has("pattern")) read_pattern(r.at("pattern"), s.pattern);
  s.proxy = r.choice("proxy", {"off", "eligible"}, 0) ? Proxy::eligible : Proxy::off;
  s.scale = r.get<float>("scale", 0.0f);
  s.seed = r.get<std::uint64_t>("seed", 0);

  MeasureOptions& m = c.measure;
  m.run.repeats = r.get_int("repeats", m.run.repeats);
  m.run.warmup = r.get_int("warmup", m.run.warmup);
  if (m.run.repeats < 1 || m.run.warmup < 1)
    Reader::fail("'repeats' and 'warmup' must be >= 1 (the first warm-up run validates the inputs)");
  static const char* const devices[] = {"auto", "cpu", "cuda"};
  m.run.device = devices[r.choice("device", {"auto", "cpu", "cuda"}, 0)];
  m.run.threads = r.get_int("threads", 0);
  m.dense_baseline = r.get<bool>("dense_baseline", false);
  if (r.has("verify")) {
    const json& v = r.at("verify");
    if (v.is_boolean()) {
      m.verify_rows = v.get<bool>() ? m.verify_rows : 0;
    } else {
      const Reader vr(v, "verify", {"rows", "seed"});
      m.verify_rows = vr.get_int("rows", m.verify_rows);
      m.verify_seed = vr.get<std::uint64_t>("seed", m.verify_seed);
    }
  }
  return c;
}

RunConfig load_run_config(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw SpecError("config: cannot read " + path);
  std::stringstream text;
  text << f.rdbuf();
  return parse_run_config(text.str());
}

}  // namespace bsattn::tools
