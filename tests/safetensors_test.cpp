// The checkpoint container: a round trip of every supported dtype, and every truncation, every
// byte flip and an interrupted write detected as a zt::DataError that names the file.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "checkpoint/safetensors.h"
#include "support/process.h"
#include "zerotrain/error.h"

namespace {

namespace fs = std::filesystem;

fs::path temp_file(const std::string& name) {
  static const fs::path dir = zt::testing::make_temp_dir("safetensors");
  return dir / name;
}

std::vector<torch::Tensor> sample_tensors() {
  torch::manual_seed(3);
  return {torch::randn({3, 5}),
          torch::randn({7}).to(torch::kBFloat16),
          torch::randn({2, 2}).to(torch::kHalf),
          torch::arange(4, torch::kLong) * 1'000'000'007LL,
          torch::empty({0}, torch::kByte),
          torch::tensor({true, false, true}),
          torch::tensor(2.5, torch::kDouble)};
}

fs::path write_sample(const fs::path& path) {
  auto tensors = sample_tensors();
  std::vector<zt::TensorRecord> records;
  for (size_t i = 0; i < tensors.size(); ++i)
    records.push_back({"t" + std::to_string(i), tensors[i].scalar_type(), tensors[i].sizes().vec()});
  zt::SafetensorsWriter writer(path, records, {{"format", "test"}, {"step", "12"}});
  for (const auto& t : tensors) writer.write(t);
  writer.finish();
  EXPECT_EQ(int64_t(fs::file_size(path)), writer.bytes());
  return path;
}

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void spit(const fs::path& path, const std::string& bytes) { std::ofstream(path, std::ios::binary) << bytes; }

// Opening and reading every tensor: throws on any detected problem.
void read_everything(const fs::path& path) {
  zt::SafetensorsReader reader(path);
  for (const auto& e : reader.entries()) reader.read(e.name);
}

}  // namespace

TEST(Safetensors, RoundTripKeepsDtypesShapesValuesAndMetadata) {
  const auto path = write_sample(temp_file("roundtrip.safetensors"));
  const auto tensors = sample_tensors();
  zt::SafetensorsReader reader(path);
  ASSERT_EQ(reader.entries().size(), tensors.size());
  EXPECT_EQ(reader.metadata(), (std::map<std::string, std::string>{{"format", "test"}, {"step", "12"}}));
  EXPECT_EQ(reader.entries().front().offset % 8, 0) << "the data section starts 8-byte aligned";
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& e = reader.entries()[i];
    EXPECT_EQ(e.name, "t" + std::to_string(i));
    auto t = reader.read(e.name);
    EXPECT_EQ(t.scalar_type(), tensors[i].scalar_type()) << e.name;
    EXPECT_EQ(t.sizes(), tensors[i].sizes()) << e.name;
    EXPECT_TRUE(torch::equal(t, tensors[i])) << e.name;
  }
  EXPECT_THROW(reader.read("missing"), zt::DataError);
}

// The layout is the published one: an 8-byte little-endian length, a JSON object of
// {dtype, shape, data_offsets} per tensor plus string-valued __metadata__, then the bytes.
TEST(Safetensors, LayoutFollowsTheFormat) {
  const auto path = write_sample(temp_file("layout.safetensors"));
  const std::string script = R"(
import json, struct, sys
data = open(sys.argv[1], 'rb').read()
n, = struct.unpack('<Q', data[:8])
header = json.loads(data[8:8 + n])
assert all(isinstance(v, str) for v in header.pop('__metadata__').values())
end = 0
for name, info in sorted(header.items(), key=lambda kv: kv[1]['data_offsets']):
    assert set(info) == {'dtype', 'shape', 'data_offsets'}, info
    begin, stop = info['data_offsets']
    assert begin == end, (name, begin, end)
    end = stop
assert 8 + n + end == len(data)
assert abs(struct.unpack('<f', data[8 + n:8 + n + 4])[0] - float(sys.argv[2])) < 1e-5
print('ok')
)";
  const float first = sample_tensors()[0].reshape({-1})[0].item<float>();
  auto r = zt::testing::run_process({"/usr/bin/env", "python3", "-c", script, path.string(), std::to_string(first)}, {},
                                    std::chrono::seconds(60));
  EXPECT_EQ(r.exit_code, 0) << r.output;
}

// Python's safetensors package (the reference reader) opens the file and sees the same dtypes,
// shapes, values and metadata.
TEST(Safetensors, OpensInPythonsSafetensors) {
  const auto path = write_sample(temp_file("python.safetensors"));
  const std::string script = R"(
import json, sys
from safetensors import safe_open
out = {}
with safe_open(sys.argv[1], 'pt') as f:
    out['__metadata__'] = f.metadata()
    for name in f.keys():
        t = f.get_tensor(name)
        out[name] = {'dtype': str(t.dtype), 'shape': list(t.shape), 'values': t.double().flatten().tolist()}
print('RESULT ' + json.dumps(out))
)";
  auto r = zt::testing::run_process({"/usr/bin/env", "python3", "-c", script, path.string()},
                                    {{"PYTHONPATH", ZT_PYTHONPATH}, {"PYTHONWARNINGS", "ignore"}},
                                    std::chrono::seconds(120));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const auto at = r.output.find("RESULT ");
  ASSERT_NE(at, std::string::npos) << r.output;
  const auto found = nlohmann::json::parse(r.output.substr(at + 7, r.output.find('\n', at) - at - 7));
  EXPECT_EQ(found["__metadata__"]["format"], "test");
  EXPECT_EQ(found["__metadata__"]["step"], "12");
  const auto tensors = sample_tensors();
  const char* torch_names[] = {"torch.float32", "torch.bfloat16", "torch.float16", "torch.int64",
                               "torch.uint8",   "torch.bool",     "torch.float64"};
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = found["t" + std::to_string(i)];
    EXPECT_EQ(t["dtype"], torch_names[i]) << i;
    EXPECT_EQ(t["shape"].get<std::vector<int64_t>>(), tensors[i].sizes().vec()) << i;
    const auto expected = tensors[i].to(torch::kDouble).reshape({-1});
    ASSERT_EQ(int64_t(t["values"].size()), expected.numel()) << i;
    for (int64_t k = 0; k < expected.numel(); ++k)
      EXPECT_EQ(t["values"][k].get<double>(), expected[k].item<double>()) << "t" << i << "[" << k << "]";
  }
}

// Writes `damaged` and expects reading it whole to fail with a DataError naming the file.
void expect_detected(const fs::path& path, const std::string& damaged, const std::string& what) {
  spit(path, damaged);
  try {
    read_everything(path);
    ADD_FAILURE() << what << " not detected";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

TEST(Safetensors, EveryTruncationIsDetected) {
  const std::string bytes = slurp(write_sample(temp_file("truncate.safetensors")));
  for (size_t length = 0; length < bytes.size(); ++length)
    expect_detected(temp_file("truncated.safetensors"), bytes.substr(0, length),
                    "truncation to " + std::to_string(length) + " of " + std::to_string(bytes.size()) + " bytes");
}

TEST(Safetensors, EveryByteFlipIsDetected) {
  const std::string bytes = slurp(write_sample(temp_file("flip.safetensors")));
  std::mt19937 rng(11);
  for (size_t at = 0; at < bytes.size(); ++at) {
    std::string copy = bytes;
    copy[at] = char(copy[at] ^ (1 << (rng() % 8)));
    expect_detected(temp_file("flipped.safetensors"), copy, "flip at byte " + std::to_string(at));
  }
}

TEST(Safetensors, AnInterruptedWriteIsNeverValid) {
  const auto path = temp_file("interrupted.safetensors");
  {
    zt::SafetensorsWriter writer(path, {{"a", torch::kFloat, {4}}, {"b", torch::kFloat, {4}}});
    writer.write(torch::ones({4}));
    writer.write(torch::ones({4}));
    // destroyed without finish(): the checksums were never written
  }
  try {
    read_everything(path);
    ADD_FAILURE() << "an unfinished file must be rejected";
  } catch (const zt::DataError& e) {
    EXPECT_NE(std::string(e.what()).find("header fails its checksum"), std::string::npos) << e.what();
  }
}

TEST(Safetensors, WriterMisuseIsAnError) {
  const auto path = temp_file("misuse.safetensors");
  EXPECT_THROW(zt::SafetensorsWriter(path, {{"a", torch::kFloat, {2}}, {"a", torch::kFloat, {2}}}), zt::Error);
  EXPECT_THROW(zt::SafetensorsWriter(path, {{"a", torch::kFloat, {2}}}, {{"zerotrain.crc32", "x"}}), zt::Error);
  zt::SafetensorsWriter writer(path, {{"a", torch::kFloat, {2}}, {"b", torch::kLong, {3}}});
  EXPECT_THROW(writer.write(torch::ones({3})), zt::Error) << "wrong shape";
  writer.write(torch::ones({2}));
  EXPECT_THROW(writer.finish(), zt::Error) << "one tensor missing";
  EXPECT_THROW(writer.write(torch::ones({3})), zt::Error) << "wrong dtype";
  writer.write(torch::ones({3}, torch::kLong));
  writer.finish();
  EXPECT_NO_THROW(read_everything(path));
  EXPECT_THROW(zt::SafetensorsReader(temp_file("absent.safetensors")), zt::DataError);
}

namespace {

// A file with the given raw header text (its checksum filled in as the writer does, so that only
// the property under test is wrong) followed by `data_bytes` zero bytes. `entries` is the JSON
// text of the tensor entries, without braces; every tensor named in `crc_names` gets a checksum.
std::string hostile_file(const std::string& entries, int64_t data_bytes, const std::vector<std::string>& crc_names = {}) {
  std::string meta = R"("__metadata__":{)";
  for (const auto& name : crc_names) meta += "\"zerotrain.crc32:" + name + "\":\"" + zt::crc32_hex(std::string(size_t(data_bytes), '\0')) + "\",";
  meta += R"("zerotrain.crc32":"00000000"})";
  std::string header = "{" + meta + (entries.empty() ? "" : "," + entries) + "}";
  const std::string crc = zt::crc32_hex(header);
  header.replace(header.find("\"zerotrain.crc32\":\"00000000\""), 28, "\"zerotrain.crc32\":\"" + crc + "\"");
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(uint64_t(header.size()) >> (8 * i));
  return bytes + header + std::string(size_t(data_bytes), '\0');
}

std::string with_length_prefix(std::string bytes, uint64_t length) {
  for (int i = 0; i < 8; ++i) bytes[size_t(i)] = char(length >> (8 * i));
  return bytes;
}

}  // namespace

// Hostile files: each refused by the reader with a zt::DataError naming the file and the
// problem; none crashes, allocates by a size it claims, or is read past its end. (The header
// checksums are right: they protect against damage, not against a file made this way.)
TEST(Safetensors, HostileFilesAreRefused) {
  // The crafted baseline is valid: what fails below fails for the one property changed.
  const std::string valid = hostile_file(R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, {"a"});
  spit(temp_file("hostile-valid.safetensors"), valid);
  ASSERT_NO_THROW(read_everything(temp_file("hostile-valid.safetensors")));
  struct Case {
    std::string what, bytes, expected;
  };
  const std::string t = R"("a":{"dtype":"F32",)";
  std::vector<Case> cases = {
      {"header length 2^63", with_length_prefix(valid, uint64_t(1) << 63), "header length 9223372036854775808"},
      {"header length 2^64-1", with_length_prefix(valid, ~uint64_t(0)), "does not fit"},
      {"header length beyond the file", with_length_prefix(valid, valid.size()), "does not fit"},
      {"offsets past the end", hostile_file(t + R"("shape":[4],"data_offsets":[0,16]})", 8, {"a"}), "bytes left in the file"},
      {"offsets past the end, shape consistent", hostile_file(t + R"("shape":[2],"data_offsets":[0,8]})", 4, {"a"}), "bytes left in the file"},
      {"offsets disagree with the shape", hostile_file(t + R"("shape":[1],"data_offsets":[0,8]})", 8, {"a"}), "data_offsets [0, 8) expected [0, 4)"},
      {"offsets beyond int64", hostile_file(t + R"("shape":[2],"data_offsets":[0,18446744073709551615]})", 8, {"a"}), "data_offsets"},
      {"negative offsets", hostile_file(t + R"("shape":[2],"data_offsets":[-8,0]})", 8, {"a"}), "data_offsets"},
      {"overlapping tensors",
       hostile_file(t + R"("shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]})", 16, {"a", "b"}),
       "tensor 'b': data_offsets [4, 12) expected [8, 16)"},
      {"the same range twice",
       hostile_file(t + R"("shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, {"a", "b"}),
       "tensor 'b'"},
      {"negative dimension", hostile_file(t + R"("shape":[-2],"data_offsets":[0,8]})", 8, {"a"}), "negative"},
      {"dimension beyond int64", hostile_file(t + R"("shape":[18446744073709551615],"data_offsets":[0,8]})", 8, {"a"}), "negative"},
      {"element count overflows", hostile_file(t + R"("shape":[4294967296,4294967296],"data_offsets":[0,0]})", 8, {"a"}),
       "more bytes than a 64-bit size holds"},
      {"byte count overflows", hostile_file(t + R"("shape":[4611686018427387904],"data_offsets":[0,0]})", 8, {"a"}),
       "more bytes than a 64-bit size holds"},
      {"huge but representable size", hostile_file(t + R"("shape":[1099511627776],"data_offsets":[0,4398046511104]})", 8, {"a"}),
       "4398046511104 bytes, more than the 8 bytes left"},
      {"fractional dimension", hostile_file(t + R"("shape":[2.5],"data_offsets":[0,8]})", 8, {"a"}), "non-integer"},
      {"unknown dtype", hostile_file(R"("a":{"dtype":"F8","shape":[2],"data_offsets":[0,8]})", 8, {"a"}), "unknown dtype"},
      {"dtype disagrees with the size", hostile_file(R"("a":{"dtype":"F64","shape":[2],"data_offsets":[0,8]})", 8, {"a"}), "bytes left"},
      {"name with a slash", hostile_file(R"("../a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, {"../a"}), "contains a path separator"},
      {"name with ..", hostile_file(R"("a..b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8, {"a..b"}), "contains '..'"},
      {"name with NUL", hostile_file(R"("a\u0000b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8), "control character"},
      {"empty name", hostile_file(R"("":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", 8), "is empty"},
      {"extra field", hostile_file(t + R"("shape":[2],"data_offsets":[0,8],"x":1})", 8, {"a"}), "expected exactly"},
      {"deep nesting", hostile_file(R"("a":{"dtype":"F32","shape":[[[[2]]]],"data_offsets":[0,8]})", 8), "nests deeper than 3"},
      {"not an object", with_length_prefix(std::string(8, '\0') + "[1,2,3]", 7), "header is not a JSON object"},
  };
  {
    // A header nested a million levels deep.
    std::string deep = std::string(1'000'000, '[') + std::string(1'000'000, ']');
    cases.push_back({"a million levels", with_length_prefix(std::string(8, '\0') + deep, deep.size()), "nests deeper than 3"});
    // A million and one tensors (zero bytes each): refused before a document is built.
    std::string many;
    many.reserve(40'000'000);
    for (int i = 0; i <= 1'000'000; ++i)
      many += (i ? ",\"" : "\"") + std::to_string(i) + R"(":{"dtype":"U8","shape":[0],"data_offsets":[0,0]})";
    cases.push_back({"a million and one tensors", hostile_file(many, 0), "more than 1000001 entries"});
  }
  for (const Case& c : cases) {
    const fs::path path = temp_file("hostile.safetensors");
    spit(path, c.bytes);
    try {
      read_everything(path);
      ADD_FAILURE() << c.what << ": not refused";
    } catch (const zt::DataError& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(path.string()), std::string::npos) << c.what << ": " << message;
      EXPECT_NE(message.find(c.expected), std::string::npos) << c.what << ": " << message.substr(0, 300);
      EXPECT_EQ(message.find('\n'), std::string::npos) << c.what << ": one line";
    }
  }
}

// Names that could become paths are refused by the writer too.
TEST(Safetensors, WriterRefusesNamesThatArePaths) {
  const auto path = temp_file("names.safetensors");
  for (const std::string& name : std::vector<std::string>{"../x", "a/b", "a\\b", std::string("a\0b", 3), "x..y", "", "__metadata__"})
    EXPECT_THROW(zt::SafetensorsWriter(path, {{name, torch::kFloat, {2}}}), zt::Error) << name;
  EXPECT_THROW(zt::SafetensorsWriter(path, {{"a", torch::kFloat, {-1}}}), zt::Error);
  EXPECT_THROW(zt::SafetensorsWriter(path, {{"a", torch::kFloat, {int64_t(1) << 62, 4}}}), zt::Error);
  EXPECT_NO_THROW(zt::SafetensorsWriter(path, {{"h.0.attn.weight", torch::kFloat, {2}}, {"master:wte.weight:0", torch::kFloat, {2}}}));
}
