#include "shm_heap.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <system_error>
#include <utility>

namespace tpk {
namespace {

using Clock = std::chrono::steady_clock;

// Busy polls before the first deadline check: a peer that is about to signal usually does so
// within a few microseconds, and a clock read per iteration would dominate that.
constexpr int kSpins = 2000;
// After spinning, yield the core for this long: ranks often outnumber cores, and the peer being
// waited for may need this very core to make progress.
constexpr auto kYieldPhase = std::chrono::milliseconds(2);
// Then sleep, doubling from the first to the last duration, to stop burning a core on long waits
// (a peer still computing) while keeping the added latency at most kMaxSleep.
constexpr auto kMinSleep = std::chrono::microseconds(20);
constexpr auto kMaxSleep = std::chrono::microseconds(1000);
constexpr auto kPollEvery = std::chrono::milliseconds(50);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

std::size_t page_size() {
  static const std::size_t size = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  return size;
}

std::size_t round_up(std::size_t n, std::size_t unit) { return (n + unit - 1) / unit * unit; }

[[noreturn]] void throw_errno(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

std::string format_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3f", s);
  return buf;
}

}  // namespace

ShmHeap::ShmHeap(std::string group_name, int rank, int world_size, std::string name_prefix,
                 std::size_t data_bytes, std::size_t signal_words)
    : group_name_(std::move(group_name)),
      rank_(rank),
      world_size_(world_size),
      name_prefix_(std::move(name_prefix)) {
  if (world_size < 1) {
    throw std::invalid_argument("world_size must be >= 1, got " + std::to_string(world_size));
  }
  if (rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank must be in [0, " + std::to_string(world_size) + "), got " +
                                std::to_string(rank));
  }
  // POSIX shm names are "/name" with no further slash; the longest segment name must also fit
  // in NAME_MAX (255) once the rank is appended.
  if (name_prefix_.size() < 2 || name_prefix_[0] != '/' ||
      name_prefix_.find('/', 1) != std::string::npos || name_prefix_.size() > 200) {
    throw std::invalid_argument(
        "name_prefix must be '/' followed by 1 to 199 characters without '/', got '" +
        name_prefix_ + "'");
  }
  if (data_bytes == 0) throw std::invalid_argument("data_bytes must be > 0, got 0");
  if (signal_words == 0) throw std::invalid_argument("signal_words must be > 0, got 0");
  data_bytes_ = round_up(data_bytes, page_size());
  signal_words_ = signal_words;
  pad_span_ = round_up(signal_words * sizeof(std::uint32_t), page_size());
  segment_bytes_ = pad_span_ + data_bytes_;
  bases_.assign(static_cast<std::size_t>(world_size), nullptr);
}

ShmHeap::~ShmHeap() {
  for (void* base : bases_) {
    if (base != nullptr) munmap(base, segment_bytes_);
  }
  if (linked_) shm_unlink(segment_name(rank_).c_str());
}

std::string ShmHeap::segment_name(int rank) const {
  check_rank(rank, "rank");
  return name_prefix_ + std::to_string(rank);
}

void* ShmHeap::map_segment(int fd, const std::string& name) const {
  void* base = mmap(nullptr, segment_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("mmap of shared-memory segment '" + name + "' (" +
                std::to_string(segment_bytes_) + " bytes)");
  }
  close(fd);
  return base;
}

void ShmHeap::create() {
  if (created_) throw std::logic_error("create() called twice on the same heap");
  const std::string name = segment_name(rank_);
  const int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open('" + name + "', O_CREAT | O_EXCL)");
  created_ = true;
  linked_ = true;
  if (ftruncate(fd, static_cast<off_t>(segment_bytes_)) != 0) {
    const int err = errno;
    close(fd);
    errno = err;
    throw_errno("ftruncate of '" + name + "' to " + std::to_string(segment_bytes_) + " bytes");
  }
  // Reserve the pages now, so that a full /dev/shm fails here with ENOSPC instead of as a SIGBUS
  // at the first write into the buffer.
  const int err = posix_fallocate(fd, 0, static_cast<off_t>(segment_bytes_));
  if (err != 0 && err != EOPNOTSUPP && err != EINVAL) {
    close(fd);
    errno = err;
    throw_errno("reserving " + std::to_string(segment_bytes_) + " bytes for '" + name +
                "' (is /dev/shm full?)");
  }
  bases_[static_cast<std::size_t>(rank_)] = map_segment(fd, name);
}

void ShmHeap::map_peers() {
  if (!created_) throw std::logic_error("map_peers() called before create()");
  for (int r = 0; r < world_size_; ++r) {
    if (bases_[static_cast<std::size_t>(r)] != nullptr) continue;
    const std::string name = segment_name(r);
    const int fd = shm_open(name.c_str(), O_RDWR, 0);
    if (fd < 0) {
      throw_errno("shm_open('" + name + "') of rank " + std::to_string(r) +
                  "'s segment (is every rank of the group on this host and in the same IPC "
                  "namespace?)");
    }
    struct stat st {};
    if (fstat(fd, &st) != 0) {
      const int err = errno;
      close(fd);
      errno = err;
      throw_errno("fstat of '" + name + "'");
    }
    if (static_cast<std::size_t>(st.st_size) != segment_bytes_) {
      close(fd);
      throw std::runtime_error("segment '" + name + "' of rank " + std::to_string(r) + " has " +
                               std::to_string(st.st_size) + " bytes, expected " +
                               std::to_string(segment_bytes_) +
                               " (did the ranks ask for different sizes?)");
    }
    bases_[static_cast<std::size_t>(r)] = map_segment(fd, name);
  }
}

void ShmHeap::unlink() {
  if (!linked_) return;
  linked_ = false;
  const std::string name = segment_name(rank_);
  if (shm_unlink(name.c_str()) != 0 && errno != ENOENT) throw_errno("shm_unlink('" + name + "')");
}

void ShmHeap::check_rank(int rank, const char* argument) const {
  if (rank < 0 || rank >= world_size_) {
    throw std::out_of_range(std::string(argument) + " must be in [0, " +
                            std::to_string(world_size_) + "), got " + std::to_string(rank));
  }
}

void ShmHeap::check_word(std::size_t word) const {
  if (word >= signal_words_) {
    throw std::out_of_range("signal word must be in [0, " + std::to_string(signal_words_) +
                            "), got " + std::to_string(word));
  }
}

void* ShmHeap::data_ptr(int rank) const {
  check_rank(rank, "rank");
  void* base = bases_[static_cast<std::size_t>(rank)];
  if (base == nullptr) {
    throw std::logic_error("the segment of rank " + std::to_string(rank) + " is not mapped");
  }
  return static_cast<char*>(base) + pad_span_;
}

std::uint32_t* ShmHeap::signal_pad(int rank) const {
  check_rank(rank, "rank");
  void* base = bases_[static_cast<std::size_t>(rank)];
  if (base == nullptr) {
    throw std::logic_error("the segment of rank " + std::to_string(rank) + " is not mapped");
  }
  return static_cast<std::uint32_t*>(base);
}

// One wait's clock: when it started, when it gives up, and the timeout it was given.
struct ShmHeap::Deadline {
  Clock::time_point start;
  Clock::time_point end;
  double timeout_s;

  explicit Deadline(double seconds) : start(Clock::now()), timeout_s(seconds) {
    if (!(seconds > 0.0) || !std::isfinite(seconds)) {
      throw std::invalid_argument("timeout_s must be a positive finite number of seconds, got " +
                                  std::to_string(seconds));
    }
    end = start + std::chrono::duration_cast<Clock::duration>(
                      std::chrono::duration<double>(seconds));
  }
};

void ShmHeap::put_signal(int dst_rank, std::size_t word, double timeout_s,
                         const std::string& what, const PollFn& poll) const {
  check_rank(dst_rank, "dst_rank");
  check_word(word);
  swap_until(dst_rank, word, 0, 1, __ATOMIC_RELEASE, dst_rank, Deadline(timeout_s), what, poll);
}

void ShmHeap::wait_signal(int src_rank, std::size_t word, double timeout_s,
                          const std::string& what, const PollFn& poll) const {
  check_rank(src_rank, "src_rank");
  check_word(word);
  swap_until(rank_, word, 1, 0, __ATOMIC_ACQUIRE, src_rank, Deadline(timeout_s), what, poll);
}

void ShmHeap::barrier(std::size_t channel, double timeout_s, const std::string& what,
                      const PollFn& poll) const {
  const std::size_t ws = static_cast<std::size_t>(world_size_);
  check_word(channel * ws + ws - 1);
  const Deadline deadline(timeout_s);
  const std::size_t base = channel * ws;
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    swap_until(peer, base + static_cast<std::size_t>(rank_), 0, 1, __ATOMIC_RELEASE, peer,
               deadline, what, poll);
  }
  for (int peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    swap_until(rank_, base + static_cast<std::size_t>(peer), 1, 0, __ATOMIC_ACQUIRE, peer,
               deadline, what, poll);
  }
}

void store_release(std::uint32_t* word, std::uint32_t value) {
  __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

std::uint32_t ShmHeap::load_signal(int rank, std::size_t word) const {
  check_word(word);
  return __atomic_load_n(signal_pad(rank) + word, __ATOMIC_ACQUIRE);
}

void ShmHeap::swap_until(int pad_owner, std::size_t word_index, std::uint32_t expected,
                         std::uint32_t desired, int success_order, int peer,
                         const Deadline& deadline, const std::string& what,
                         const PollFn& poll) const {
  std::uint32_t* word = signal_pad(pad_owner) + word_index;
  const auto try_swap = [&] {
    // A relaxed load first keeps the cache line shared while the value is still wrong.
    if (__atomic_load_n(word, __ATOMIC_RELAXED) != expected) return false;
    std::uint32_t seen = expected;
    return __atomic_compare_exchange_n(word, &seen, desired, false, success_order,
                                       __ATOMIC_RELAXED);
  };
  for (int i = 0; i < kSpins; ++i) {
    if (try_swap()) return;
    cpu_relax();
  }
  const auto started = Clock::now();
  auto next_poll = started + kPollEvery;
  auto sleep = kMinSleep;
  while (true) {
    if (try_swap()) return;
    const auto now = Clock::now();
    if (now >= deadline.end) break;
    if (poll && now >= next_poll) {
      poll();
      next_poll = now + kPollEvery;
    }
    if (now - started < kYieldPhase) {
      sched_yield();
    } else {
      const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(sleep).count();
      const timespec ts{static_cast<time_t>(ns / 1000000000), static_cast<long>(ns % 1000000000)};
      nanosleep(&ts, nullptr);
      sleep = std::min(sleep * 2, kMaxSleep);
    }
  }
  const double waited = std::chrono::duration<double>(Clock::now() - deadline.start).count();
  const std::uint32_t value = __atomic_load_n(word, __ATOMIC_RELAXED);
  throw SignalTimeout("tp_kernels symmetric memory: rank " + std::to_string(rank_) +
                      " of group '" + group_name_ + "' gave up after " + format_seconds(waited) +
                      " s (timeout " + format_seconds(deadline.timeout_s) +
                      " s) waiting for peer rank " + std::to_string(peer) + ": " + what +
                      " (signal word " + std::to_string(word_index) + " of rank " +
                      std::to_string(pad_owner) + "'s pad holds " + std::to_string(value) +
                      ", needed " + std::to_string(expected) + ")");
}

}  // namespace tpk
