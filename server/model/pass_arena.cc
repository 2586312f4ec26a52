#include "server/model/pass_arena.h"

#include <c10/util/Exception.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "server/model/kernels.h"
#include "server/util/process_memory.h"

namespace collabserve::model {

PassArena& PassArena::Shared() {
  static PassArena arena(std::chrono::seconds(10));
  return arena;
}

PassArena::PassArena(std::chrono::milliseconds idle_release) : idle_release_(idle_release) {}

PassArena::~PassArena() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (idle_.joinable()) idle_.join();
}

PassArena::Lease::Lease(Lease&& other) noexcept : arena_(other.arena_), data_(other.data_) {
  other.arena_ = nullptr;
  other.data_ = nullptr;
}

PassArena::Lease& PassArena::Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    if (arena_ != nullptr) arena_->Release();
    arena_ = other.arena_;
    data_ = other.data_;
    other.arena_ = nullptr;
    other.data_ = nullptr;
  }
  return *this;
}

PassArena::Lease::~Lease() {
  if (arena_ != nullptr) arena_->Release();
}

PassArena::Lease PassArena::TryLease(int64_t floats) {
  TORCH_CHECK(floats >= 1, "PassArena::TryLease: ", floats, " floats (want >= 1)");
  std::lock_guard<std::mutex> l(mu_);
  if (leased_) return Lease();
  if (!pages_.defined() || floats > pages_.numel()) {
    const int64_t grown = std::max(floats, pages_.defined() ? 2 * pages_.numel() : int64_t{0});
    pages_ = at::Tensor();  // the old mapping goes first
    pages_ = PagesOfItsOwn(grown, at::TensorOptions(), /*populate=*/false);  // a pass faults in what it uses
  }
  StartIdleLoopLocked();  // first: if it throws, no lease is counted that nothing would end
  leased_ = true;
  resident_ = true;
  return Lease(this, pages_.data_ptr<float>());
}

PassArena::Pass PassArena::BeginPass() {
  util::BindThreadToRetainingArena();
  std::lock_guard<std::mutex> l(mu_);
  StartIdleLoopLocked();  // first: if it throws, no Pass is counted that nothing would end
  ++passes_;
  resident_ = true;
  return Pass(this);
}

PassArena::Pass::~Pass() {
  if (arena_ != nullptr) arena_->EndPass();
}

void PassArena::EndPass() {
  {
    std::lock_guard<std::mutex> l(mu_);
    --passes_;
    last_release_ = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

void PassArena::StartIdleLoopLocked() {
  if (!idle_.joinable()) idle_ = std::thread([this] { IdleLoop(); });
}

void PassArena::Release() {
  {
    std::lock_guard<std::mutex> l(mu_);
    leased_ = false;
    last_release_ = std::chrono::steady_clock::now();
  }
  cv_.notify_all();
}

void PassArena::IdleLoop() {
  std::unique_lock<std::mutex> l(mu_);
  while (!stop_) {
    if (leased_ || passes_ > 0 || !resident_) {
      cv_.wait(l);
      continue;
    }
    const auto due = last_release_ + idle_release_;
    if (std::chrono::steady_clock::now() < due) {
      cv_.wait_until(l, due);
      continue;
    }
    GiveBackLocked();
  }
}

void PassArena::ReleaseIfIdle() {
  std::lock_guard<std::mutex> l(mu_);
  if (!leased_ && passes_ == 0 && resident_) GiveBackLocked();
}

void PassArena::GiveBackLocked() {
  // The pages back to the system (read as zeros when touched again); the mapping stays.
  if (pages_.defined()) madvise(pages_.data_ptr(), static_cast<size_t>(MappedBytesLocked()), MADV_DONTNEED);
  util::PurgeRetainingArena();
  resident_ = false;
}

int64_t PassArena::MappedBytesLocked() const {
  if (!pages_.defined()) return 0;
  const int64_t page = sysconf(_SC_PAGESIZE);
  return (pages_.numel() * static_cast<int64_t>(sizeof(float)) + page - 1) / page * page;
}

int64_t PassArena::mapped_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  return MappedBytesLocked();
}

int64_t PassArena::resident_bytes() const {
  std::lock_guard<std::mutex> l(mu_);
  const int64_t bytes = MappedBytesLocked();
  if (bytes == 0) return 0;
  const int64_t page = sysconf(_SC_PAGESIZE);
  std::vector<unsigned char> in(static_cast<size_t>(bytes / page));
  TORCH_CHECK(mincore(pages_.data_ptr(), static_cast<size_t>(bytes), in.data()) == 0, "mincore: ", std::strerror(errno));
  int64_t pages = 0;
  for (unsigned char c : in) pages += c & 1;
  return pages * page;
}

}  // namespace collabserve::model
