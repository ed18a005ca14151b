// CPU symmetric heap: one POSIX shared-memory segment per local rank of a group, each mapped by
// every rank, each holding a signal pad of 32-bit words followed by a data region.
//
// Segment layout (both parts start on a page boundary, so any dtype is aligned):
//   [0, pad_span)                      signal pad: signal_words uint32 words, zero-filled
//   [pad_span, pad_span + data_bytes)  data region: data_bytes bytes, zero-filled
//
// Lifecycle, driven collectively by the caller (every rank runs each step, with a barrier between
// steps): create() the own segment -> map_peers() -> unlink() the own name once every rank has
// mapped every segment, so that a crash afterwards leaves nothing in /dev/shm. The destructor
// unmaps everything and unlinks the own name if that has not happened yet (a failed setup).
//
// Signals follow the CUDA symmetric-memory convention: a word is 0 when idle. put_signal waits
// until a word of a peer's pad is 0 and sets it to 1 (release); wait_signal waits until a word of
// the own pad is 1 and sets it back to 0 (acquire). Both are single compare-and-swap operations, so
// a signal is neither lost (a second put waits for the first to be consumed) nor counted twice.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace tpk {

// A wait passed its deadline. The message names the group, both ranks, the word and the time.
class SignalTimeout : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Called every few tens of milliseconds while a wait blocks; may throw to abandon the wait
// (the Python binding uses it to deliver KeyboardInterrupt).
using PollFn = std::function<void()>;

// Release store of a 32-bit word in this process's memory: the CPU copier's progress words
// (a chunk's copy, then its word), which the consumer kernel reads with acquire loads.
void store_release(std::uint32_t* word, std::uint32_t value);

class ShmHeap {
 public:
  // name_prefix: "/<something unique to this allocation>_"; rank r's segment is
  // name_prefix + std::to_string(r). data_bytes is rounded up to a whole number of pages.
  // Throws std::invalid_argument on bad arguments.
  ShmHeap(std::string group_name, int rank, int world_size, std::string name_prefix,
          std::size_t data_bytes, std::size_t signal_words);
  ~ShmHeap();
  ShmHeap(const ShmHeap&) = delete;
  ShmHeap& operator=(const ShmHeap&) = delete;

  void create();     // own segment: shm_open(O_CREAT | O_EXCL), size, reserve, mmap
  void map_peers();  // every other rank's segment; checks each one's size
  void unlink();     // own name; idempotent

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  std::size_t data_bytes() const { return data_bytes_; }
  std::size_t signal_words() const { return signal_words_; }
  const std::string& name_prefix() const { return name_prefix_; }
  std::string segment_name(int rank) const;

  // Addresses in this process's mapping of `rank`'s segment (mapped ranks only).
  void* data_ptr(int rank) const;
  std::uint32_t* signal_pad(int rank) const;

  // Waits until word `word` of dst_rank's pad is 0, then sets it to 1 (release).
  void put_signal(int dst_rank, std::size_t word, double timeout_s, const std::string& what,
                  const PollFn& poll) const;
  // Waits until word `word` of the own pad is 1, then sets it to 0 (acquire). src_rank only names
  // the peer in a timeout message.
  void wait_signal(int src_rank, std::size_t word, double timeout_s, const std::string& what,
                   const PollFn& poll) const;
  // Puts a signal on `channel` to every peer (word channel * world_size + rank of each peer's
  // pad), then waits for every peer's signal (word channel * world_size + peer of the own pad),
  // all within one timeout.
  void barrier(std::size_t channel, double timeout_s, const std::string& what,
               const PollFn& poll) const;
  // Acquire load of a word of `rank`'s pad (for diagnostics and tests).
  std::uint32_t load_signal(int rank, std::size_t word) const;

 private:
  void check_rank(int rank, const char* argument) const;
  void check_word(std::size_t word) const;
  void* map_segment(int fd, const std::string& name) const;
  struct Deadline;
  // Compare-and-swap `expected` -> `desired` on word `word_index` of pad_owner's pad, retrying
  // until the deadline; throws SignalTimeout naming `peer`, the word and `what` if it never
  // succeeds.
  void swap_until(int pad_owner, std::size_t word_index, std::uint32_t expected,
                  std::uint32_t desired, int success_order, int peer, const Deadline& deadline,
                  const std::string& what, const PollFn& poll) const;

  std::string group_name_;
  int rank_;
  int world_size_;
  std::string name_prefix_;
  std::size_t data_bytes_;
  std::size_t signal_words_;
  std::size_t pad_span_;
  std::size_t segment_bytes_;
  std::vector<void*> bases_;  // per rank; nullptr until mapped
  bool created_ = false;
  bool linked_ = false;
};

}  // namespace tpk
