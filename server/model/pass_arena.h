// Memory for the activations of one encoder pass at a time, kept from one pass to the next.
#ifndef COLLABSERVE_SERVER_MODEL_PASS_ARENA_H_
#define COLLABSERVE_SERVER_MODEL_PASS_ARENA_H_

#include <ATen/core/Tensor.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>

namespace collabserve::model {

// A team pass (encoder_team.cc) needs ~40 MB of activations at 8 × 128 tokens and ~460 MB at
// 32 × 512. Taken from the allocator and freed after each pass, those pages went back to the
// system and were faulted in again on the next pass (jemalloc's decay purges freed pages at the
// rate a steady stream of passes frees them): with jemalloc told never to give pages back, 8 × 128,
// 32 × 128 and 32 × 512 passes took 14-25% less time; with the arena, 8 × 128 and 32 × 128 ~15%.
// The arena keeps one mapping, grown to the largest pass it has served, whose pages the next pass
// finds resident; after `idle_release` without a lease it gives the pages back to the system (the
// mapping stays, and the next pass faults them in once), so that a burst of large batches does not
// pin its memory.
//
// One lease at a time: TryLease while another lease is live returns an empty lease (the caller
// then allocates as it would without the arena). Thread-safe.
//
// Everything else a pass allocates (the per-operation path's tensors, the sgemm's workspace, the
// embeddings; a second pass running beside the one holding the lease) comes from the allocator.
// A Pass (BeginPass) puts its thread on the allocator's retaining arena
// (util::BindThreadToRetainingArena: jemalloc, as collabserve links it), which keeps freed pages
// for the next pass instead of purging them; the idle release gives those back too. BERT-base, 2
// batch threads x 1 thread each (the server's default on 2 CPUs): 8 x 128 9.4 -> 17.7 inputs/s,
// 32 x 32 39 -> 72 (bench/engine/RESULTS.md, 2026-12-03).
class PassArena {
 public:
  // The process-wide arena (idle release after 10 s).
  static PassArena& Shared();

  explicit PassArena(std::chrono::milliseconds idle_release);
  ~PassArena();
  PassArena(const PassArena&) = delete;
  PassArena& operator=(const PassArena&) = delete;

  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& other) noexcept;
    Lease& operator=(Lease&& other) noexcept;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease();
    // At least the floats asked for, 64-byte aligned; null for an empty lease. Its contents are
    // whatever the last pass left (zero after a release to the system).
    float* data() const { return data_; }
    explicit operator bool() const { return data_ != nullptr; }

   private:
    friend class PassArena;
    Lease(PassArena* arena, float* data) : arena_(arena), data_(data) {}
    PassArena* arena_ = nullptr;
    float* data_ = nullptr;
  };

  // A forward pass on the calling thread while it lives: the thread allocates from the retaining
  // arena from now on, and the idle release waits until no Pass and no lease is live. Any number
  // at once, on any threads.
  class Pass {
   public:
    Pass(Pass&& other) noexcept : arena_(other.arena_) { other.arena_ = nullptr; }
    Pass(const Pass&) = delete;
    Pass& operator=(const Pass&) = delete;
    Pass& operator=(Pass&&) = delete;
    ~Pass();

   private:
    friend class PassArena;
    explicit Pass(PassArena* arena) : arena_(arena) {}
    PassArena* arena_;
  };
  Pass BeginPass();

  // A lease of at least `floats` floats (>= 1), or an empty one while another lease is live.
  // Grows the mapping (to at least twice its size: only the pages a pass touches are resident)
  // when it is too small. Throws when the system has no memory to map.
  Lease TryLease(int64_t floats);

  // Gives the pages back to the system now, as an idle_release does (the mapping's, and the
  // retaining arena's freed pages), unless a lease or a Pass is live.
  void ReleaseIfIdle();

  // The mapping's size in bytes (0 before the first lease).
  int64_t mapped_bytes() const;
  // How many of its bytes are resident now (mincore).
  int64_t resident_bytes() const;

 private:
  void Release();
  void EndPass();
  void StartIdleLoopLocked();
  void IdleLoop();
  void GiveBackLocked();  // mu_ held, no lease live
  int64_t MappedBytesLocked() const;

  const std::chrono::milliseconds idle_release_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  at::Tensor pages_;  // PagesOfItsOwn
  bool leased_ = false;
  int passes_ = 0;         // live Pass objects
  bool resident_ = false;  // a lease or a Pass since the last release to the system
  std::chrono::steady_clock::time_point last_release_;
  bool stop_ = false;
  std::thread idle_;  // started with the first lease or Pass
};

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_PASS_ARENA_H_
