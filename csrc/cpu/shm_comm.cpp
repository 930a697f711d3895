// Shared-memory LL all-reduce and fused GEMM + all-reduce: the CPU twins of SwiftSpec's
// latency-optimized communication kernels (paper section 3.3, "Fused GEMM with all reduce";
// SwiftSpec paper section 3.3). The TP ranks of one group are processes on one host; they share one POSIX
// shared-memory segment and exchange data as LL8 words (csrc/include/swiftspec/ll_protocol.h):
// every 8-byte word carries 4 bytes of payload and the 4-byte flag of the collective's epoch, so a
// reader knows a word is complete by its flag alone, with no barrier between writer and reader
// (NCCL's LL protocol, src/device/prims_ll.h; mscclpp's LL8 packets).
//
// Segment layout (all offsets 64-byte aligned, every line written by one rank only):
//   [SegmentHeader][RankLine x size][EpochLine x size][buffers: kNumSlots x size x words_ LL8 words]
// Buffer (slot, r) is written by rank r only and read by every other rank.
//
// One-shot algorithm, per epoch e (one epoch per chunk of at most capacity bytes per rank):
//   1. write the local payload into buffer (slot_of_epoch(e), rank) with flag_of_epoch(e);
//   2. for every element, sum the ranks' values in the fixed order 0..size-1 in fp32 (the local
//      rank's values are read from local memory, the same bits it wrote), spinning on each peer
//      word until its flag is the epoch's: every rank performs the same float operations in the
//      same order, so every rank gets identical bits;
//   3. advance this rank's epoch counter, which lives in the segment (the op advances it itself).
// Double buffering by epoch parity makes step 1 of epoch e+1 safe without a barrier: a rank that
// finished epoch e has read every peer's epoch-e words, so every peer has finished epoch e-1 and
// no longer reads the slot that epoch e+1 overwrites.
//
// Stale words. Epochs move different amounts of data. If epoch e-2 wrote fewer words of a slot than
// an older epoch, the words past it would still hold that older epoch's flag, which, once flags
// wrap around, can equal flag_of_epoch(e): a reader would take stale data for fresh. So each rank
// remembers how many words it last wrote into each slot (EpochLine::high_water, in the segment) and
// zeroes the excess when an epoch writes fewer. Then a reader of epoch e only ever meets words of
// epoch e, epoch e-2 or zero, as ll_protocol.h assumes, and any other flag is reported as ranks out
// of step (different op sequences or shapes).
//
// Fused GEMM + all-reduce: the local partial product of the row-parallel linear is computed tile by
// tile of output columns and every finished tile is pushed right away, so faster peers can reduce
// early tiles while later ones compute; then every tile is reduced in rank order and the bias added
// once, after the reduction. A tile's GEMM is the weight-streaming skinny core (skinny_gemm.h, the
// kernel of ops.linear) for decode-sized M <= 16 in fp32 / bf16, else at::mm (oneDNN / MKL).
//
// Waiting never hangs: spin with _mm_pause, then sched_yield (more ranks than cores), then short
// sleeps; every few dozen rounds check the clock, whether the peer closed its communicator and
// whether its process is alive (kill(pid, 0) plus /proc/<pid>/stat for unreaped zombies). A dead or
// closed peer or the timeout raises a RuntimeError naming the rank, and the communicator is
// unusable afterwards (the ranks' epochs no longer agree).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/csrc/utils/pybind.h>

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SWIFTSPEC_PAUSE() _mm_pause()
#else
#define SWIFTSPEC_PAUSE() ((void)0)
#endif

#include "skinny_gemm.h"
#include "swiftspec/ll_protocol.h"

namespace swiftspec {
namespace {

constexpr uint64_t kMagic = 0x53574654534d4d31ull;  // "SWFTSMM1"
constexpr uint32_t kLayoutVersion = 1;
constexpr int64_t kLine = 64;

// Spin phases of a waiting reader (see wait_slow).
constexpr int64_t kPauseSpins = 1024;       // ~30 us of _mm_pause (~25-40 ns each), then yield
constexpr int64_t kCheckEvery = 64;         // rounds between clock / abort checks once yielding
constexpr double kSleepAfterS = 0.02;       // then stop burning a core: short sleeps
constexpr double kLivenessEveryS = 0.02;    // peer liveness checks (a syscall and a /proc read)

// Work split: segments of at most kSplitWords words; a thread takes at least ~kGrainWords words.
constexpr int64_t kSplitWords = 4096;
constexpr int64_t kGrainWords = 16384;
// Elements reduced per inner block (fp32 accumulators on the stack).
constexpr int64_t kBlock = 256;
// Fused GEMM: at most this many column tiles, each at least kMinTileCols wide.
constexpr int64_t kMaxTiles = 8;
constexpr int64_t kMinTileCols = 64;

// out = x @ w[n0 : n0 + cols].T rounded to x's dtype (as at::mm). x [rows, K] and w [N, K]
// contiguous, out [rows, cols] with contiguous rows. rows <= skinny::kMaxRows in fp32 / bf16 runs
// the skinny core (parallel over the tile's columns), anything else at::mm_out.
void tile_gemm(const at::Tensor& x, const at::Tensor& w, int64_t n0, int64_t cols, at::Tensor& out) {
  const at::ScalarType t = x.scalar_type();
  if (x.size(0) > skinny::kMaxRows || (t != at::kFloat && t != at::kBFloat16)) {
    at::mm_out(out, x, w.narrow(0, n0, cols).t());
    return;
  }
  const bool bf16 = t == at::kBFloat16;
  skinny::gemm(skinny::best_impl(bf16), skinny::problem_of(x, w), n0, n0 + cols,
               skinny::StoreEpilogue{out.data_ptr(), out.stride(0), n0, nullptr, bf16});
}

struct alignas(64) SegmentHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t flag_bits;
  int64_t size;
  int64_t words;        // LL8 words per (slot, rank) buffer
  int64_t total_bytes;
};

enum RankState : int64_t { kNotAttached = 0, kAttached = 1, kClosed = 2 };

struct alignas(64) RankLine {
  int64_t pid;
  int64_t state;  // RankState
};

struct alignas(64) EpochLine {
  uint64_t epoch;                       // the next epoch this rank runs
  int64_t high_water[ll::kNumSlots];    // words this rank wrote in each slot at its last epoch there
};

static_assert(sizeof(SegmentHeader) == kLine && sizeof(RankLine) == kLine && sizeof(EpochLine) == kLine,
              "header lines must be one cache line each");

double monotonic_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// Whether process `pid` still runs. kill(pid, 0) succeeds for an exited child its parent has not
// reaped yet (a zombie), so the state letter in /proc/<pid>/stat is checked as well.
bool process_alive(int64_t pid) {
  if (pid <= 0) return true;  // unknown: only the timeout can tell
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
  char path[64];
  snprintf(path, sizeof(path), "/proc/%lld/stat", static_cast<long long>(pid));
  FILE* f = fopen(path, "r");
  if (f == nullptr) return true;  // no procfs: trust kill()
  char buf[512];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = '\0';
  // "pid (comm) S ...": comm may contain spaces and parentheses, the state follows the last ')'
  const char* close = strrchr(buf, ')');
  if (close == nullptr || close[1] == '\0' || close[2] == '\0') return true;
  char state = close[2];
  return state != 'Z' && state != 'X';
}

// ---- element <-> fp32 conversion (round to nearest even, as torch) --------------------------

inline float to_f32(float v) { return v; }
inline float to_f32(c10::BFloat16 v) {
  uint32_t u = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f32(c10::Half v) { return static_cast<float>(v); }

template <typename T>
inline T from_f32(float f);
template <>
inline float from_f32<float>(float f) { return f; }
template <>
inline c10::BFloat16 from_f32<c10::BFloat16>(float f) {
  // c10's round_to_nearest_even, written without a branch so the loop vectorizes
  uint32_t u;
  std::memcpy(&u, &f, 4);
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7FC0u : rounded), c10::BFloat16::from_bits());
}
template <>
inline c10::Half from_f32<c10::Half>(float f) { return c10::Half(f); }

// ---- per-op shared state of the threads of one collective --------------------------------------

struct OpState {
  std::atomic<bool> abort{false};
  std::mutex mu;
  std::string message;  // the first failure, reported to Python

  [[noreturn]] void fail(const std::string& msg) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (message.empty()) message = msg;
    }
    abort.store(true, std::memory_order_relaxed);
    throw std::runtime_error(msg);
  }
};

// One contiguous run of elements: its words in the buffers, the local values, where the sum goes
// and (fused GEMM) the bias to add after the reduction.
struct Segment {
  int64_t word_off;  // first word inside each rank's buffer of the slot
  const void* own;   // n local elements
  void* dst;         // n output elements (may alias own: in-place all-reduce)
  const void* bias;  // n bias elements or nullptr
  int64_t n;
};

class ShmComm {
 public:
  ShmComm(const std::string& name, int64_t rank, int64_t size, bool create, int64_t capacity_bytes,
          double timeout_s)
      : name_(name), rank_(rank), size_(size), creator_(create), timeout_s_(timeout_s) {
    TORCH_CHECK(size >= 1 && size <= 4096, "ShmComm: size must be in [1, 4096], got ", size);
    TORCH_CHECK(rank >= 0 && rank < size, "ShmComm: rank ", rank, " out of range for size ", size);
    TORCH_CHECK(capacity_bytes > 0 && capacity_bytes <= (int64_t{1} << 36),
                "ShmComm: capacity_bytes must be in (0, 64 GiB], got ", capacity_bytes);
    TORCH_CHECK(timeout_s > 0 && std::isfinite(timeout_s), "ShmComm: timeout_s must be > 0, got ", timeout_s);
    TORCH_CHECK(name.size() >= 2 && name.size() < 250 && name[0] == '/' && name.find('/', 1) == std::string::npos,
                "ShmComm: name must look like '/name' (one leading slash, no other), got '", name, "'");
    // whole cache lines per buffer, so every rank's buffer starts on its own line
    words_ = (ll::words_for_bytes(capacity_bytes) + 7) / 8 * 8;
    off_ranks_ = kLine;
    off_epochs_ = off_ranks_ + kLine * size;
    off_buffers_ = off_epochs_ + kLine * size;
    bytes_ = off_buffers_ + static_cast<int64_t>(ll::kNumSlots) * size * words_ * 8;
    if (create) {
      open_created();
    } else {
      open_attached();
    }
  }

  ~ShmComm() { close(); }

  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  // Removes the name; the mapping stays valid for every rank already attached.
  void unlink() {
    if (unlinked_) return;
    if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
      int err = errno;
      TORCH_CHECK(false, "ShmComm: shm_unlink(", name_, ") failed: ", strerror(err));
    }
    unlinked_ = true;
  }

  // Unmaps the segment (peers waiting on this rank then fail fast instead of timing out). The
  // creator also removes the name if nobody did, so an aborted setup leaks nothing.
  void close() noexcept {
    if (base_ == nullptr) return;
    if (busy_.load()) return;  // another thread is inside an op; the destructor will come later
    __atomic_store_n(&rank_line(rank_)->state, static_cast<int64_t>(kClosed), __ATOMIC_RELEASE);
    if (creator_ && !unlinked_) {
      shm_unlink(name_.c_str());
      unlinked_ = true;
    }
    munmap(base_, static_cast<size_t>(bytes_));
    base_ = nullptr;
  }

  // In-place sum of x over the ranks (see the file comment).
  void all_reduce(const at::Tensor& x) {
    TORCH_CHECK(x.device().is_cpu(), "ShmComm.all_reduce: x must be a CPU tensor, got ", x.device());
    TORCH_CHECK(x.is_contiguous(), "ShmComm.all_reduce: x must be contiguous");
    check_dtype(x.scalar_type(), "ShmComm.all_reduce: x");
    OpGuard guard(this);
    const int64_t n = x.numel();
    if (size_ == 1 || n == 0) return;
    const int64_t esize = x.element_size();
    const int64_t chunk = words_ * (4 / esize);  // elements per epoch
    char* data = static_cast<char*>(x.data_ptr());
    run_guarded([&] {
      for (int64_t start = 0; start < n; start += chunk) {
        const int64_t len = std::min(chunk, n - start);
        void* p = data + start * esize;
        std::vector<Segment> segs;
        split_segment(Segment{0, p, p, nullptr, len}, esize, segs);
        const uint64_t e = begin_epoch();
        push(segs, e, esize);
        finish_writes(e, ll::words_for_bytes(len * esize));
        reduce(segs, e, x.scalar_type());
        end_epoch(e);
      }
    });
  }

  // all_reduce(x @ w^T) (+ bias), fused (see the file comment). x [M, K], w [N, K], bias [N].
  at::Tensor gemm_all_reduce(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias) {
    TORCH_CHECK(x.dim() == 2 && w.dim() == 2, "ShmComm.gemm_all_reduce: x and w must be 2-D, got ", x.sizes(),
                " and ", w.sizes());
    TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "ShmComm.gemm_all_reduce: tensors must be on the CPU");
    TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "ShmComm.gemm_all_reduce: x and w must be contiguous");
    check_dtype(x.scalar_type(), "ShmComm.gemm_all_reduce: x");
    TORCH_CHECK(w.scalar_type() == x.scalar_type(), "ShmComm.gemm_all_reduce: w dtype ", w.scalar_type(),
                " differs from x dtype ", x.scalar_type());
    TORCH_CHECK(x.size(1) == w.size(1), "ShmComm.gemm_all_reduce: x is ", x.sizes(), " but w is ", w.sizes(),
                " (the inner dimensions K differ)");
    const int64_t M = x.size(0), N = w.size(0);
    const void* bias_ptr = nullptr;
    if (bias.has_value()) {
      const at::Tensor& b = *bias;
      TORCH_CHECK(b.device().is_cpu() && b.is_contiguous() && b.dim() == 1 && b.size(0) == N,
                  "ShmComm.gemm_all_reduce: bias must be a contiguous CPU tensor of shape [", N, "], got ",
                  b.sizes());
      TORCH_CHECK(b.scalar_type() == x.scalar_type(), "ShmComm.gemm_all_reduce: bias dtype ", b.scalar_type(),
                  " differs from x dtype ", x.scalar_type());
      bias_ptr = b.data_ptr();
    }
    OpGuard guard(this);
    at::Tensor out = at::empty({M, N}, x.options());
    if (M == 0 || N == 0) return out;
    const int64_t esize = x.element_size();
    const int64_t epw = 4 / esize;  // elements per word
    auto row_words = [&](int64_t cols) { return ll::words_for_bytes(cols * esize); };
    // Column tiles: up to kMaxTiles, but never wider than one buffer.
    int64_t nt = std::max(kMinTileCols, (((N + kMaxTiles - 1) / kMaxTiles) + 15) / 16 * 16);
    nt = std::min({nt, N, words_ * epw});
    // Rows per epoch so at least one tile fits; then as many tiles per epoch as fit.
    const int64_t rm = std::min(M, words_ / row_words(nt));
    const int64_t tiles_per_epoch = std::max<int64_t>(1, words_ / (rm * row_words(nt)));
    const int64_t n_tiles = (N + nt - 1) / nt;
    char* out_base = static_cast<char*>(out.data_ptr());
    const char* bias_base = static_cast<const char*>(bias_ptr);
    if (size_ == 1) {
      // nothing to exchange, but the same float operations as the fused path
      tile_gemm(x, w, 0, N, out);
      if (bias_ptr != nullptr) {
        std::vector<Segment> segs;
        for (int64_t r = 0; r < M; ++r) {
          char* row = out_base + r * N * esize;
          segs.push_back(Segment{0, row, row, bias_ptr, N});
        }
        add_bias_local(segs, x.scalar_type());
      }
      return out;
    }
    run_guarded([&] {
      for (int64_t r0 = 0; r0 < M; r0 += rm) {
        const int64_t rows = std::min(rm, M - r0);
        const at::Tensor xr = x.narrow(0, r0, rows);
        for (int64_t t0 = 0; t0 < n_tiles; t0 += tiles_per_epoch) {
          const int64_t t1 = std::min(n_tiles, t0 + tiles_per_epoch);
          const uint64_t e = begin_epoch();
          std::vector<at::Tensor> partials;  // keep the tiles alive until reduced
          std::vector<Segment> segs;
          int64_t word_off = 0;
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t n0 = t * nt, cols = std::min(nt, N - n0);
            at::Tensor part = at::empty({rows, cols}, x.options());
            tile_gemm(xr, w, n0, cols, part);
            TORCH_INTERNAL_ASSERT(part.is_contiguous());
            const char* pbase = static_cast<const char*>(part.data_ptr());
            const size_t first = segs.size();
            for (int64_t i = 0; i < rows; ++i) {
              // each row starts on a word boundary so it is a contiguous run in both buffers
              split_segment(Segment{word_off, pbase + i * cols * esize,
                                    out_base + ((r0 + i) * N + n0) * esize,
                                    bias_base ? bias_base + n0 * esize : nullptr, cols},
                            esize, segs);
              word_off += row_words(cols);
            }
            // push this tile now: peers may already be waiting for it
            std::vector<Segment> tile(segs.begin() + static_cast<std::ptrdiff_t>(first), segs.end());
            push(tile, e, esize);
            partials.push_back(std::move(part));
          }
          finish_writes(e, word_off);
          reduce(segs, e, x.scalar_type());
          end_epoch(e);
        }
      }
    });
    return out;
  }

  const std::string& name() const { return name_; }
  int64_t rank() const { return rank_; }
  int64_t size() const { return size_; }
  int64_t capacity_bytes() const { return words_ * ll::kPayloadBytes; }
  bool closed() const { return base_ == nullptr; }
  uint64_t epoch() const {
    TORCH_CHECK(base_ != nullptr, "ShmComm: closed");
    return __atomic_load_n(&epoch_line(rank_)->epoch, __ATOMIC_ACQUIRE);
  }

 private:
  // Marks the communicator busy for one op (ops are not reentrant; epochs must stay in order).
  struct OpGuard {
    explicit OpGuard(ShmComm* c) : comm(c) {
      TORCH_CHECK(comm->base_ != nullptr, "ShmComm rank ", comm->rank_, ": the communicator is closed");
      TORCH_CHECK(comm->broken_.empty(), "ShmComm rank ", comm->rank_,
                  ": unusable after an earlier failure (", comm->broken_, ")");
      bool expected = false;
      TORCH_CHECK(comm->busy_.compare_exchange_strong(expected, true), "ShmComm rank ", comm->rank_,
                  ": called from two threads at once");
    }
    ~OpGuard() { comm->busy_.store(false); }
    ShmComm* comm;
  };

  // Runs the op's body; any failure leaves the ranks' epochs out of step, so the communicator is
  // marked unusable and the first failure's message is raised.
  template <typename F>
  void run_guarded(F&& body) {
    try {
      body();
    } catch (const std::exception& ex) {
      std::string msg;
      {
        std::lock_guard<std::mutex> lock(op_.mu);
        msg = op_.message.empty() ? std::string(ex.what()) : op_.message;
      }
      broken_ = msg;
      throw std::runtime_error(msg);
    }
  }

  static void check_dtype(at::ScalarType t, const char* what) {
    TORCH_CHECK(t == at::kFloat || t == at::kBFloat16 || t == at::kHalf, what,
                " must be float32, bfloat16 or float16, got ", t);
  }

  SegmentHeader* header() const { return reinterpret_cast<SegmentHeader*>(base_); }
  RankLine* rank_line(int64_t r) const { return reinterpret_cast<RankLine*>(base_ + off_ranks_ + kLine * r); }
  EpochLine* epoch_line(int64_t r) const {
    return reinterpret_cast<EpochLine*>(base_ + off_epochs_ + kLine * r);
  }
  uint64_t* buffer(int slot, int64_t r) const {
    return reinterpret_cast<uint64_t*>(base_ + off_buffers_) + (static_cast<int64_t>(slot) * size_ + r) * words_;
  }

  void open_created() {
    int fd = shm_open(name_.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) {
      int err = errno;
      TORCH_CHECK(false, "ShmComm: creating shared memory ", name_, " failed: ", strerror(err));
    }
    // posix_fallocate reserves the pages now: a tmpfs that is too small fails here instead of
    // killing a rank with SIGBUS on first touch; the new pages read as zero (flag 0: no data).
    int err = posix_fallocate(fd, 0, static_cast<off_t>(bytes_));
    if (err != 0) {
      ::close(fd);
      shm_unlink(name_.c_str());
      TORCH_CHECK(false, "ShmComm: reserving ", bytes_, " bytes of shared memory for ", name_,
                  " failed: ", strerror(err), " (is /dev/shm large enough? lower capacity_bytes)");
    }
    void* p = mmap(nullptr, static_cast<size_t>(bytes_), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    err = errno;
    ::close(fd);
    if (p == MAP_FAILED) {
      shm_unlink(name_.c_str());
      TORCH_CHECK(false, "ShmComm: mmap of ", name_, " failed: ", strerror(err));
    }
    base_ = static_cast<char*>(p);
    SegmentHeader* h = header();
    h->version = kLayoutVersion;
    h->flag_bits = ll::kFlagBits;
    h->size = size_;
    h->words = words_;
    h->total_bytes = bytes_;
    rank_line(rank_)->pid = static_cast<int64_t>(getpid());
    __atomic_store_n(&rank_line(rank_)->state, static_cast<int64_t>(kAttached), __ATOMIC_RELEASE);
    __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
  }

  void open_attached() {
    int fd = shm_open(name_.c_str(), O_RDWR, 0);
    if (fd < 0) {
      int err = errno;
      TORCH_CHECK(false, "ShmComm rank ", rank_, ": attaching to shared memory ", name_, " failed: ",
                  strerror(err));
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || st.st_size < static_cast<off_t>(sizeof(SegmentHeader))) {
      ::close(fd);
      TORCH_CHECK(false, "ShmComm rank ", rank_, ": ", name_, " is not a ShmComm segment (too small)");
    }
    void* p = mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);
    TORCH_CHECK(p != MAP_FAILED, "ShmComm rank ", rank_, ": mmap of ", name_, " failed: ", strerror(err));
    const SegmentHeader* h = static_cast<const SegmentHeader*>(p);
    std::ostringstream bad;
    if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != kMagic || h->version != kLayoutVersion) {
      bad << "is not a ShmComm segment of this version";
    } else if (h->flag_bits != ll::kFlagBits) {
      bad << "was created by a build with " << h->flag_bits << " LL flag bits, this one has " << ll::kFlagBits;
    } else if (h->size != size_ || h->words != words_ || h->total_bytes != bytes_ ||
               static_cast<int64_t>(st.st_size) != bytes_) {
      bad << "has size " << h->size << " and " << h->words * ll::kPayloadBytes
          << " capacity bytes, this rank expects size " << size_ << " and " << words_ * ll::kPayloadBytes;
    }
    if (!bad.str().empty()) {
      munmap(p, static_cast<size_t>(st.st_size));
      TORCH_CHECK(false, "ShmComm rank ", rank_, ": ", name_, " ", bad.str());
    }
    base_ = static_cast<char*>(p);
    RankLine* line = rank_line(rank_);
    const int64_t old_pid = __atomic_load_n(&line->pid, __ATOMIC_ACQUIRE);
    const int64_t old_state = __atomic_load_n(&line->state, __ATOMIC_ACQUIRE);
    if (old_state != kNotAttached) {
      munmap(base_, static_cast<size_t>(bytes_));
      base_ = nullptr;
      TORCH_CHECK(false, "ShmComm rank ", rank_, ": rank ", rank_, " of ", name_, " was already attached (pid ",
                  old_pid, ")");
    }
    line->pid = static_cast<int64_t>(getpid());
    __atomic_store_n(&line->state, static_cast<int64_t>(kAttached), __ATOMIC_RELEASE);
  }

  uint64_t begin_epoch() {
    op_.abort.store(false);
    op_.message.clear();
    return __atomic_load_n(&epoch_line(rank_)->epoch, __ATOMIC_RELAXED);
  }

  void end_epoch(uint64_t e) { __atomic_store_n(&epoch_line(rank_)->epoch, e + 1, __ATOMIC_RELEASE); }

  // Cuts a segment into pieces of at most kSplitWords words (cut at word boundaries).
  static void split_segment(const Segment& s, int64_t esize, std::vector<Segment>& out) {
    const int64_t per = kSplitWords * (4 / esize);
    for (int64_t i = 0; i < s.n; i += per) {
      const int64_t len = std::min(per, s.n - i);
      out.push_back(Segment{s.word_off + i / (4 / esize), static_cast<const char*>(s.own) + i * esize,
                            static_cast<char*>(s.dst) + i * esize,
                            s.bias ? static_cast<const char*>(s.bias) + i * esize : nullptr, len});
    }
  }

  static int64_t grain_for(const std::vector<Segment>& segs, int64_t esize) {
    int64_t words = 0;
    for (const Segment& s : segs) words += ll::words_for_bytes(s.n * esize);
    const int64_t avg = std::max<int64_t>(1, words / std::max<int64_t>(1, static_cast<int64_t>(segs.size())));
    return std::max<int64_t>(1, kGrainWords / avg);
  }

  // Writes the local values of `segs` as LL8 words with the epoch's flag into this rank's buffer.
  void push(const std::vector<Segment>& segs, uint64_t e, int64_t esize) {
    uint64_t* buf = buffer(ll::slot_of_epoch(e), rank_);
    const uint32_t flag = ll::flag_of_epoch(e);
    at::parallel_for(0, static_cast<int64_t>(segs.size()), grain_for(segs, esize), [&](int64_t b, int64_t end) {
      for (int64_t k = b; k < end; ++k) {
        const Segment& s = segs[k];
        const int64_t bytes = s.n * esize;
        const int64_t full = bytes / 4;
        const char* src = static_cast<const char*>(s.own);
        uint64_t* dst = buf + s.word_off;
        for (int64_t j = 0; j < full; ++j) {
          uint32_t v;
          std::memcpy(&v, src + 4 * j, 4);  // 16-bit types: element 2j low, 2j+1 high (little endian)
          __atomic_store_n(dst + j, ll::pack8(v, flag), __ATOMIC_RELEASE);
        }
        if (bytes % 4 != 0) {  // odd count of 16-bit elements: zero high half
          uint32_t v = 0;
          std::memcpy(&v, src + 4 * full, static_cast<size_t>(bytes % 4));
          __atomic_store_n(dst + full, ll::pack8(v, flag), __ATOMIC_RELEASE);
        }
      }
    });
  }

  // After epoch e wrote `words` words of its slot: zero the words an earlier, larger epoch left
  // there, so no stale flag can ever match a later epoch's (see the file comment).
  void finish_writes(uint64_t e, int64_t words) {
    const int slot = ll::slot_of_epoch(e);
    int64_t* hw = &epoch_line(rank_)->high_water[slot];
    const int64_t old = __atomic_load_n(hw, __ATOMIC_RELAXED);
    uint64_t* buf = buffer(slot, rank_);
    for (int64_t j = words; j < old; ++j) __atomic_store_n(buf + j, uint64_t{0}, __ATOMIC_RELEASE);
    __atomic_store_n(hw, words, __ATOMIC_RELEASE);
  }

  // A word of `peer`'s buffer that is not yet at `flag`: spin, yield, then sleep; check the clock,
  // the abort flag and the peer's liveness now and then.
  uint64_t wait_slow(const uint64_t* p, uint32_t flag, uint64_t e, int64_t peer) {
    const uint32_t stale = e >= static_cast<uint64_t>(ll::kNumSlots) ? ll::flag_of_epoch(e - ll::kNumSlots) : 0u;
    int64_t spins = 0;
    double t0 = -1.0, waited = 0.0, next_liveness = 0.0;
    for (;;) {
      const uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
      const uint32_t f = ll::flag8(v);
      if (f == flag) return v;
      if (f != 0 && f != stale) {
        std::ostringstream m;
        m << "ShmComm rank " << rank_ << ": rank " << peer << " wrote LL flag " << f << " in epoch " << e
          << " (expected " << flag << ", or stale " << stale << "): the ranks are out of step (different "
          << "collective calls or shapes)";
        op_.fail(m.str());
      }
      ++spins;
      if (spins < kPauseSpins) {
        SWIFTSPEC_PAUSE();
        continue;
      }
      if (spins % kCheckEvery == 0) {
        if (op_.abort.load(std::memory_order_relaxed)) throw std::runtime_error("aborted");
        const double now = monotonic_s();
        if (t0 < 0) t0 = next_liveness = now;
        waited = now - t0;
        if (now >= next_liveness) {
          next_liveness = now + kLivenessEveryS;
          check_peer(peer, e);
        }
        if (waited > timeout_s_) {
          const RankLine* line = rank_line(peer);
          std::ostringstream m;
          m << "ShmComm rank " << rank_ << ": timed out after " << timeout_s_ << " s waiting for rank " << peer
            << " (pid " << __atomic_load_n(&line->pid, __ATOMIC_ACQUIRE) << ") in epoch " << e
            << "; is it still running the same collective calls?";
          op_.fail(m.str());
        }
      }
      if (waited > kSleepAfterS) {
        timespec ts{0, 50000};  // 50 us
        nanosleep(&ts, nullptr);
      } else {
        sched_yield();
      }
    }
  }

  void check_peer(int64_t peer, uint64_t e) {
    const RankLine* line = rank_line(peer);
    const int64_t state = __atomic_load_n(&line->state, __ATOMIC_ACQUIRE);
    const int64_t pid = __atomic_load_n(&line->pid, __ATOMIC_ACQUIRE);
    std::ostringstream m;
    if (state == kClosed) {
      m << "ShmComm rank " << rank_ << ": rank " << peer << " (pid " << pid
        << ") closed its communicator while this rank waits for it in epoch " << e;
    } else if (state == kAttached && !process_alive(pid)) {
      m << "ShmComm rank " << rank_ << ": rank " << peer << " (pid " << pid << ") exited while this rank waits "
        << "for it in epoch " << e;
    } else {
      return;
    }
    op_.fail(m.str());
  }

  inline uint64_t wait_word(const uint64_t* p, uint32_t flag, uint64_t e, int64_t peer) {
    const uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    if (__builtin_expect(ll::flag8(v) == flag, 1)) return v;
    return wait_slow(p, flag, e, peer);
  }

  void reduce(const std::vector<Segment>& segs, uint64_t e, at::ScalarType t) {
    switch (t) {
      case at::kFloat: return reduce_t<float>(segs, e);
      case at::kBFloat16: return reduce_t<c10::BFloat16>(segs, e);
      case at::kHalf: return reduce_t<c10::Half>(segs, e);
      default: TORCH_CHECK(false, "ShmComm: unsupported dtype ", t);
    }
  }

  // dst = round(sum over ranks 0..size-1 in fp32) (+ bias, added in fp32 and rounded again: the
  // same operations as `round(sum) + bias` in torch).
  template <typename T>
  void reduce_t(const std::vector<Segment>& segs, uint64_t e) {
    constexpr int64_t epw = 4 / static_cast<int64_t>(sizeof(T));
    const int slot = ll::slot_of_epoch(e);
    const uint32_t flag = ll::flag_of_epoch(e);
    at::parallel_for(0, static_cast<int64_t>(segs.size()), grain_for(segs, sizeof(T)), [&](int64_t b, int64_t end) {
      float acc[kBlock];
      float val[kBlock];
      for (int64_t k = b; k < end; ++k) {
        const Segment& s = segs[k];
        const T* own = static_cast<const T*>(s.own);
        T* dst = static_cast<T*>(s.dst);
        const T* bias = static_cast<const T*>(s.bias);
        for (int64_t i0 = 0; i0 < s.n; i0 += kBlock) {
          const int64_t len = std::min(kBlock, s.n - i0);
          for (int64_t r = 0; r < size_; ++r) {
            float* v = r == 0 ? acc : val;
            if (r == rank_) {
              for (int64_t i = 0; i < len; ++i) v[i] = to_f32(own[i0 + i]);
            } else {
              const uint64_t* src = buffer(slot, r) + s.word_off + i0 / epw;
              const int64_t nw = (len + epw - 1) / epw;
              for (int64_t j = 0; j < nw; ++j) {
                const uint32_t payload = ll::payload8(wait_word(src + j, flag, e, r));
                if constexpr (epw == 1) {
                  std::memcpy(&v[j], &payload, 4);
                } else {
                  T lo, hi;
                  const uint16_t l16 = static_cast<uint16_t>(payload), h16 = static_cast<uint16_t>(payload >> 16);
                  std::memcpy(&lo, &l16, 2);
                  std::memcpy(&hi, &h16, 2);
                  v[2 * j] = to_f32(lo);
                  if (2 * j + 1 < len) v[2 * j + 1] = to_f32(hi);
                }
              }
            }
            if (r > 0) {
              for (int64_t i = 0; i < len; ++i) acc[i] += val[i];
            }
          }
          if (bias == nullptr) {
            for (int64_t i = 0; i < len; ++i) dst[i0 + i] = from_f32<T>(acc[i]);
          } else {
            for (int64_t i = 0; i < len; ++i) {
              const float y = to_f32(from_f32<T>(acc[i]));
              dst[i0 + i] = from_f32<T>(y + to_f32(bias[i0 + i]));
            }
          }
        }
      }
    });
  }

  template <typename T>
  static void add_bias_t(const std::vector<Segment>& segs) {
    for (const Segment& s : segs) {
      T* dst = static_cast<T*>(s.dst);
      const T* bias = static_cast<const T*>(s.bias);
      for (int64_t i = 0; i < s.n; ++i) dst[i] = from_f32<T>(to_f32(dst[i]) + to_f32(bias[i]));
    }
  }

  static void add_bias_local(const std::vector<Segment>& segs, at::ScalarType t) {
    switch (t) {
      case at::kFloat: return add_bias_t<float>(segs);
      case at::kBFloat16: return add_bias_t<c10::BFloat16>(segs);
      case at::kHalf: return add_bias_t<c10::Half>(segs);
      default: TORCH_CHECK(false, "ShmComm: unsupported dtype ", t);
    }
  }

  std::string name_;
  int64_t rank_, size_;
  bool creator_;
  double timeout_s_;
  int64_t words_ = 0, off_ranks_ = 0, off_epochs_ = 0, off_buffers_ = 0, bytes_ = 0;
  char* base_ = nullptr;
  bool unlinked_ = false;
  std::string broken_;
  std::atomic<bool> busy_{false};
  OpState op_;
};

}  // namespace

void register_shm_comm(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<ShmComm>(m, "ShmComm", R"doc(
Shared-memory LL all-reduce among the TP ranks (processes) of one host (SwiftSpec paper section 3.3; README.md, "Kernels").

ShmComm(name, rank, size, create, capacity_bytes, timeout_s): rank 0 creates the POSIX shared
memory segment ``name`` ('/something'; O_EXCL, zero-filled, 2 * size buffers of capacity_bytes
payload each, i.e. 4 * size * capacity_bytes bytes plus a header), the others attach with
create=False and the same size and capacity. Call ``unlink()`` once every rank attached: the
mapping stays valid and nothing can leak. Waits longer than timeout_s seconds, a peer process that
exited, or a peer that closed its communicator raise RuntimeError naming the rank; the
communicator is unusable after any failure. Raises RuntimeError on bad arguments, a name that
exists (create) or does not (attach), or a segment of another size / capacity / build.
)doc")
      .def(py::init<const std::string&, int64_t, int64_t, bool, int64_t, double>(), py::arg("name"),
           py::arg("rank"), py::arg("size"), py::arg("create"), py::arg("capacity_bytes"), py::arg("timeout_s"))
      .def("all_reduce", &ShmComm::all_reduce, py::arg("x"), py::call_guard<py::gil_scoped_release>(),
           R"doc(In-place sum of x over the ranks: every rank gets identical bits.

x: contiguous CPU tensor, float32, bfloat16 or float16, any shape and number of elements (the same
on every rank). Summed in rank order 0..size-1 in float32 and rounded once to x's dtype. Messages
larger than capacity_bytes per rank run as several epochs.)doc")
      .def("gemm_all_reduce", &ShmComm::gemm_all_reduce, py::arg("x"), py::arg("w"), py::arg("bias") = py::none(),
           py::call_guard<py::gil_scoped_release>(),
           R"doc(Row-parallel linear fused with the all-reduce: all_reduce(x @ w.T) (+ bias).

x [M, K] and w [N, K] contiguous, bias [N] or None, all of one dtype (float32, bfloat16, float16).
Returns a new [M, N] tensor of that dtype, identical on every rank. The partial product is rounded
to the dtype per tile (as x @ w.T), summed in rank order in float32, rounded, then the bias is added
(as torch's ``y + bias``).)doc")
      .def("unlink", &ShmComm::unlink, "Remove the segment's name (mapping stays valid). Idempotent.")
      .def("close", &ShmComm::close,
           "Unmap the segment (and, for the creator, remove the name if still there). Idempotent.")
      .def_property_readonly("name", &ShmComm::name)
      .def_property_readonly("rank", &ShmComm::rank)
      .def_property_readonly("size", &ShmComm::size)
      .def_property_readonly("capacity_bytes", &ShmComm::capacity_bytes,
                             "payload bytes per rank per epoch (the requested value rounded up to 64 B)")
      .def_property_readonly("closed", &ShmComm::closed)
      .def_property_readonly("epoch", &ShmComm::epoch, "epochs (chunks) this rank has completed");
}

}  // namespace swiftspec
