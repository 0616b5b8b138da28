#include "zero/partition_store.h"

#include <exception>
#include <torch/torch.h>

#include <algorithm>
#include <cstring>

#include "common/check.h"
#include "io/aio.h"
#include "zero/device_plan.h"

namespace zt {

// The offload plan counts swap files in the I/O engine's pages.
static_assert(kSwapPageBytes == io::kAlignment, "the offload plan and the I/O engine align alike");

TieredArray::TieredArray(std::string role, at::ScalarType dtype, int64_t numel, c10::Device device, bool pinned)
    : role_(std::move(role)), dtype_(dtype), numel_(numel),
      memory_(pinned && device.is_cpu() ? empty_host(numel, dtype, /*pinned=*/true).zero_()
                                        : torch::zeros({numel}, torch::TensorOptions().dtype(dtype).device(device))) {}

int64_t TieredArray::element_size() const { return int64_t(c10::elementSize(dtype_)); }

int TieredArray::group_of(int64_t begin) const {
  auto it = std::upper_bound(groups_.begin(), groups_.end(), begin,
                             [](int64_t value, const SubGroup& g) { return value < g.begin; });
  ZT_CHECK_STATE(it != groups_.begin(), "partition offset before the first sub-group");
  return int(it - groups_.begin()) - 1;
}

at::Tensor TieredArray::view(int64_t begin, int64_t n) const {
  if (disk_.empty()) return memory_.narrow(0, begin, n);
  // Memory sub-groups lie back to back in partition order: a range of them is one run.
  const int first = group_of(begin);
  for (int g = first; g < int(groups_.size()) && groups_[size_t(g)].begin < begin + n; ++g)
    ZT_CHECK_STATE(!disk_[size_t(g)], role_ + ": a view of a sub-group that is on disk");
  return memory_.narrow(0, place_[size_t(first)] + (begin - groups_[size_t(first)].begin), n);
}

int64_t TieredArray::memory_bytes() const { return memory_.defined() ? int64_t(memory_.nbytes()) : 0; }

}  // namespace zt

namespace zt {

TieredArray::TieredArray(std::string role, at::ScalarType dtype, const std::vector<SubGroup>& groups,
                         const std::vector<char>& on_disk, io::AioEngine& io, const std::filesystem::path& file,
                         bool pinned)
    : role_(std::move(role)), dtype_(dtype), groups_(groups), disk_(on_disk), io_(&io), path_(file) {
  ZT_CHECK_STATE(groups.size() == on_disk.size(), role_ + ": one tier flag per sub-group");
  int64_t memory = 0;
  place_.resize(groups.size());
  for (size_t g = 0; g < groups.size(); ++g) {
    numel_ += groups[g].numel;
    if (disk_[g]) {
      place_[g] = file_bytes_;
      file_bytes_ += io::align_up(groups[g].numel * element_size());
      ++disk_count_;
    } else {
      place_[g] = memory;
      memory += groups[g].numel;
    }
  }
  memory_ = pinned ? empty_host(memory, dtype, /*pinned=*/true).zero_() : torch::zeros({memory}, torch::TensorOptions().dtype(dtype));
  ZT_CHECK_STATE(file_bytes_ == swap_file_bytes(groups, on_disk, element_size()), role_ + ": file size formula");
  // A new swap file is created empty and allocated (fallocate), so it reads as zeros: the moments
  // start there without a write, the masters and parameters are stored next.
  if (disk_count_ > 0) file_id_ = io.open(file, file_bytes_);
}

int64_t TieredArray::buffer_bytes(int g) const { return io::align_up(groups_[size_t(g)].numel * element_size()); }

int64_t TieredArray::read(int g, void* destination) const {
  ZT_CHECK_STATE(on_disk(g), role_ + ": reading a sub-group that is in memory");
  return io_->read(file_id_, place_[size_t(g)], destination, buffer_bytes(g));
}

int64_t TieredArray::write(int g, const void* source) const {
  ZT_CHECK_STATE(on_disk(g), role_ + ": writing a sub-group that is in memory");
  return io_->write(file_id_, place_[size_t(g)], source, buffer_bytes(g));
}

void TieredArray::store(int64_t begin, const at::Tensor& values) {
  const at::Tensor flat = values.reshape({-1});
  const int64_t end = begin + flat.numel();
  if (disk_.empty()) {
    memory_.narrow(0, begin, flat.numel()).copy_(flat);
    return;
  }
  for (int g = group_of(begin); g < int(groups_.size()) && groups_[size_t(g)].begin < end; ++g) {
    const SubGroup& sg = groups_[size_t(g)];
    const int64_t from = std::max(begin, sg.begin), to = std::min(end, sg.begin + sg.numel);
    const at::Tensor piece = flat.narrow(0, from - begin, to - from);
    if (!disk_[size_t(g)]) {
      memory_.narrow(0, place_[size_t(g)] + (from - sg.begin), to - from).copy_(piece);
      continue;
    }
    io::AlignedBuffer bounce(buffer_bytes(g));
    if (from != sg.begin || to != sg.begin + sg.numel) io_->wait(read(g, bounce.data()));
    at::Tensor staged = torch::from_blob(bounce.data(), {sg.numel}, torch::TensorOptions().dtype(dtype_));
    staged.narrow(0, from - sg.begin, to - from).copy_(piece);
    io_->wait(write(g, bounce.data()));
  }
}

void TieredArray::load(int64_t begin, at::Tensor& out) const {
  at::Tensor flat = out.view({-1});
  const int64_t end = begin + flat.numel();
  if (disk_.empty()) {
    flat.copy_(memory_.narrow(0, begin, flat.numel()));
    return;
  }
  for (int g = group_of(begin); g < int(groups_.size()) && groups_[size_t(g)].begin < end; ++g) {
    const SubGroup& sg = groups_[size_t(g)];
    const int64_t from = std::max(begin, sg.begin), to = std::min(end, sg.begin + sg.numel);
    at::Tensor piece = flat.narrow(0, from - begin, to - from);
    if (!disk_[size_t(g)]) {
      piece.copy_(memory_.narrow(0, place_[size_t(g)] + (from - sg.begin), to - from));
      continue;
    }
    io::AlignedBuffer bounce(buffer_bytes(g));
    io_->wait(read(g, bounce.data()));
    piece.copy_(torch::from_blob(bounce.data(), {sg.numel}, torch::TensorOptions().dtype(dtype_))
                    .narrow(0, from - sg.begin, to - from));
  }
}

void TieredArray::fill_zero() {
  if (memory_.defined()) memory_.zero_();
  if (disk_count_ == 0) return;
  // Zeros written in large pieces from one buffer: every disk sub-group, issued together.
  int64_t largest = 0;
  for (size_t g = 0; g < groups_.size(); ++g)
    if (disk_[g]) largest = std::max(largest, buffer_bytes(int(g)));
  io::AlignedBuffer zeros(largest);
  std::memset(zeros.data(), 0, size_t(zeros.size()));
  std::vector<int64_t> tickets;
  for (size_t g = 0; g < groups_.size(); ++g)
    if (disk_[g]) tickets.push_back(write(int(g), zeros.data()));
  // Every write is waited for before `zeros` goes, also when one fails; the first failure is
  // rethrown.
  std::exception_ptr failure;
  for (int64_t t : tickets) {
    try {
      io_->wait(t);
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace zt

namespace zt {

void* TransferScratch::get(int64_t bytes) {
  if (bytes > capacity_) {
    storage_ = at::Tensor();  // the old one goes first: the peak stays at the new size
    const int64_t capacity = io::align_up(bytes);
    storage_ = torch::empty({capacity + io::kAlignment}, torch::kUInt8);
    const auto address = reinterpret_cast<uintptr_t>(storage_.data_ptr());
    aligned_ = reinterpret_cast<void*>((address + io::kAlignment - 1) / io::kAlignment * io::kAlignment);
    capacity_ = capacity;
  }
  return aligned_;
}

bool TieredArray::in_memory(int64_t begin, int64_t n) const {
  if (disk_count_ == 0 || n <= 0) return true;
  for (int g = group_of(begin); g < int(groups_.size()) && groups_[size_t(g)].begin < begin + n; ++g)
    if (disk_[size_t(g)]) return false;
  return true;
}

void TieredArray::page_span(int g, int64_t from, int64_t to, int64_t* first, int64_t* last) const {
  const SubGroup& sg = groups_[size_t(g)];
  *first = (from - sg.begin) * element_size() / io::kAlignment * io::kAlignment;
  *last = io::align_up((to - sg.begin) * element_size());
}

void TieredArray::read_elements(int64_t begin, int64_t count, void* data, TransferScratch& scratch) const {
  ZT_CHECK_STATE(begin >= 0 && count >= 0 && begin + count <= numel_, role_ + ": elements out of range");
  if (count == 0) return;
  const int64_t es = element_size(), end = begin + count;
  char* out = static_cast<char*>(data);
  const char* memory = memory_.defined() ? static_cast<const char*>(memory_.data_ptr()) : nullptr;
  if (disk_.empty()) {
    if (!memory_.is_cpu()) {  // device memory: a copy through the device's runtime
      torch::from_blob(out, {count}, memory_.options().device(c10::kCPU)).copy_(memory_.narrow(0, begin, count));
      return;
    }
    std::memcpy(out, memory + begin * es, size_t(count * es));
    return;
  }
  for (int g = group_of(begin); g < int(groups_.size()) && groups_[size_t(g)].begin < end; ++g) {
    const SubGroup& sg = groups_[size_t(g)];
    const int64_t from = std::max(begin, sg.begin), to = std::min(end, sg.begin + sg.numel);
    char* destination = out + (from - begin) * es;
    if (!disk_[size_t(g)]) {
      std::memcpy(destination, memory + (place_[size_t(g)] + from - sg.begin) * es, size_t((to - from) * es));
      continue;
    }
    int64_t first, last;
    page_span(g, from, to, &first, &last);
    char* pages = static_cast<char*>(scratch.get(last - first));
    io_->wait(io_->read(file_id_, place_[size_t(g)] + first, pages, last - first));
    std::memcpy(destination, pages + ((from - sg.begin) * es - first), size_t((to - from) * es));
  }
}

void TieredArray::write_elements(int64_t begin, int64_t count, const void* data, TransferScratch& scratch) {
  ZT_CHECK_STATE(begin >= 0 && count >= 0 && begin + count <= numel_, role_ + ": elements out of range");
  if (count == 0) return;
  const int64_t es = element_size(), end = begin + count;
  const char* in = static_cast<const char*>(data);
  char* memory = memory_.defined() ? static_cast<char*>(memory_.data_ptr()) : nullptr;
  if (disk_.empty()) {
    if (!memory_.is_cpu()) {
      memory_.narrow(0, begin, count)
          .copy_(torch::from_blob(const_cast<void*>(data), {count}, memory_.options().device(c10::kCPU)));
      return;
    }
    std::memcpy(memory + begin * es, in, size_t(count * es));
    return;
  }
  for (int g = group_of(begin); g < int(groups_.size()) && groups_[size_t(g)].begin < end; ++g) {
    const SubGroup& sg = groups_[size_t(g)];
    const int64_t from = std::max(begin, sg.begin), to = std::min(end, sg.begin + sg.numel);
    const char* source = in + (from - begin) * es;
    if (!disk_[size_t(g)]) {
      std::memcpy(memory + (place_[size_t(g)] + from - sg.begin) * es, source, size_t((to - from) * es));
      continue;
    }
    int64_t first, last;
    page_span(g, from, to, &first, &last);
    const int64_t head = (from - sg.begin) * es, tail = (to - sg.begin) * es;
    char* pages = static_cast<char*>(scratch.get(last - first));
    const int64_t at = place_[size_t(g)];
    // Partly covered first and last pages keep the bytes outside the range.
    if (head != first) io_->wait(io_->read(file_id_, at + first, pages, io::kAlignment));
    if (tail != last && (last - io::kAlignment != first || head == first))
      io_->wait(io_->read(file_id_, at + last - io::kAlignment, pages + (last - first - io::kAlignment), io::kAlignment));
    std::memcpy(pages + (head - first), source, size_t(tail - head));
    io_->wait(io_->write(file_id_, at + first, pages, last - first));
  }
}

TieredStaging::TieredStaging(TieredArray& live) : live_(live) {
  ZT_CHECK_STATE(live.any_on_disk() && live.io_ != nullptr, live.role_ + ": staging is for arrays with sub-groups on disk");
}

TieredStaging::~TieredStaging() {
  if (!created_ || committed_) return;
  try {
    live_.io_->close(staged_.file_id_);
  } catch (...) {
  }
  std::error_code ignored;
  std::filesystem::remove(staged_.path_, ignored);
}

void TieredStaging::write(int64_t begin, int64_t count, const void* values, TransferScratch& scratch) {
  ZT_CHECK_STATE(!committed_, live_.role_ + ": staging written after its commit");
  if (!created_) {
    staged_ = TieredArray(live_.role_, live_.dtype_, live_.groups_, live_.disk_, *live_.io_,
                          live_.path_.string() + ".staging");
    created_ = true;
  }
  staged_.write_elements(begin, count, values, scratch);
}

void TieredStaging::commit() {
  ZT_CHECK_STATE(!committed_, live_.role_ + ": staging committed twice");
  committed_ = true;
  if (!created_) return;  // nothing was loaded into this array on this rank
  if (live_.memory_.defined() && live_.memory_.numel() > 0) live_.memory_.copy_(staged_.memory_);
  io::AioEngine& io = *live_.io_;
  // The staging file takes the live file's name (the old one's data goes with its descriptor);
  // should the rename fail, the staging file stays under its own name and the old one is removed.
  bool renamed = true;
  try {
    io.rename(staged_.file_id_, live_.path_);
  } catch (const std::exception&) {
    renamed = false;
  }
  io.close(live_.file_id_);
  if (!renamed) {
    std::error_code ignored;
    std::filesystem::remove(live_.path_, ignored);
    live_.path_ = staged_.path_;
  }
  live_.file_id_ = staged_.file_id_;
}

}  // namespace zt
