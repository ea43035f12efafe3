// lmstack's byte-level BPE encoder core (docs/tokenizer.md; CS336 notes "分词器", "细节问答": pre-tokenization,
// hash maps, priority queues). The same algorithm as lmstack.tokenizer.Tokenizer's Python path, ids identical:
//
//   text (UTF-8) -> special tokens cut out (leftmost, longest first) -> pre-tokens -> BPE merges by rank -> ids
//
// Pre-tokens: the built-in patterns of lmstack.tokenizer.pretokenize (GPT-2, GPT-4 / cl100k, Llama-3, SmolLM2)
// as hand-written state machines, one alternative after another in the regex's order, with the regex's
// backtracking worked out by hand (e.g. `\s+(?!\S)` gives back the last whitespace character before a
// non-space). Which code points are letters (\p{L}), numbers (\p{N}) and whitespace (\s), and which fold to
// the contraction letters under (?i), come from the Python `regex` module at start-up (one byte per code
// point), so both paths agree character for character. Other patterns: Python splits, this file merges.
//
// BPE of one pre-token: repeatedly merge the adjacent pair of lowest rank, leftmost first (as HF tokenizers);
// short pieces scan a rank array, long ones (CJK runs, long whitespace) use a linked list and a min-heap of
// (rank, position) with lazy deletion. Pair -> (rank, merged id) is an open-addressing hash table.
// Merged pieces are cached (bytes -> ids) in a table split in shards, each behind its own mutex, so that
// threads share one cache; a shard that reaches its share of cache_size is emptied (bounded memory, as the
// Python cache). Every call releases the GIL while it encodes; encode_batch runs its texts on threads.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <queue>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint8_t kL = 1, kN = 2, kS = 4;  // \p{L}, \p{N}, \s; 0 = anything else ([^\s\p{L}\p{N}])
enum Kind { GPT2 = 0, GPT4 = 1, LLAMA3 = 2, SMOLLM = 3, CUSTOM = -1 };
constexpr uint32_t kNoRank = 0xFFFFFFFFu;
constexpr uint32_t kDead = 0xFFFFFFFFu;
constexpr size_t kNone = SIZE_MAX;
constexpr size_t kShortPiece = 96;    // ids: scan a rank array below this, heap at or above
constexpr size_t kMaxCachedPiece = 256;  // bytes: longer pre-tokens are merged every time, never cached
constexpr size_t kShards = 16;

inline uint64_t mix64(uint64_t x) {
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  x *= 0xd6e8feb86659fd93ULL;
  x ^= x >> 32;
  return x;
}

inline uint64_t hash_bytes(const uint8_t* p, size_t n) {
  uint64_t h = 0x9E3779B97F4A7C15ULL ^ (n * 0x100000001B3ULL);
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = mix64(h ^ w);
    p += 8;
    n -= 8;
  }
  uint64_t w = 0;
  std::memcpy(&w, p, n);
  return mix64(h ^ w ^ (uint64_t)n << 59);
}

// (left id, right id) -> (rank, merged id); open addressing, linear probing, rank == kNoRank marks empty.
struct MergeTable {
  struct Slot {
    uint64_t key;
    uint32_t rank, merged;
  };
  std::vector<Slot> slots;
  uint64_t mask = 0;

  void init(size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 16) cap <<= 1;
    slots.assign(cap, Slot{0, kNoRank, 0});
    mask = cap - 1;
  }
  void insert(uint32_t a, uint32_t b, uint32_t rank, uint32_t merged) {  // the first insert of a pair wins
    uint64_t key = (uint64_t)a << 32 | b;
    for (uint64_t i = mix64(key) & mask;; i = (i + 1) & mask) {
      Slot& s = slots[i];
      if (s.rank == kNoRank) {
        s = Slot{key, rank, merged};
        return;
      }
      if (s.key == key) return;
    }
  }
  inline uint32_t rank(uint32_t a, uint32_t b) const {
    uint64_t key = (uint64_t)a << 32 | b;
    for (uint64_t i = mix64(key) & mask;; i = (i + 1) & mask) {
      const Slot& s = slots[i];
      if (s.rank == kNoRank) return kNoRank;
      if (s.key == key) return s.rank;
    }
  }
};

// One shard of the piece cache: bytes -> ids, keys and values in flat arenas.
struct Shard {
  struct Entry {
    uint64_t hash;
    uint32_t koff, klen, voff, vlen;
  };
  std::mutex mu;
  std::vector<uint32_t> slots;  // 0 = empty, else entry index + 1
  std::vector<Entry> entries;
  std::vector<uint8_t> keys;
  std::vector<uint32_t> vals;
  size_t limit = 1;

  void clear() {
    slots.assign(64, 0);
    entries.clear();
    keys.clear();
    vals.clear();
  }
  // Appends the cached ids of p[0:n] to out; false when absent.
  bool get(uint64_t h, const uint8_t* p, size_t n, std::vector<uint32_t>& out) const {
    size_t mask = slots.size() - 1;
    for (size_t i = (h >> 20) & mask;; i = (i + 1) & mask) {
      uint32_t e = slots[i];
      if (e == 0) return false;
      const Entry& en = entries[e - 1];
      if (en.hash == h && en.klen == n && std::memcmp(keys.data() + en.koff, p, n) == 0) {
        out.insert(out.end(), vals.begin() + en.voff, vals.begin() + en.voff + en.vlen);
        return true;
      }
    }
  }
  void put(uint64_t h, const uint8_t* p, size_t n, const uint32_t* ids, size_t m) {
    if (entries.size() >= limit) clear();
    if (2 * (entries.size() + 1) > slots.size()) {  // grow: keep the load factor at most 1/2
      std::vector<uint32_t> bigger(slots.size() * 2, 0);
      size_t mask = bigger.size() - 1;
      for (size_t e = 0; e < entries.size(); ++e) {
        size_t i = (entries[e].hash >> 20) & mask;
        while (bigger[i]) i = (i + 1) & mask;
        bigger[i] = (uint32_t)(e + 1);
      }
      slots.swap(bigger);
    }
    size_t mask = slots.size() - 1;
    size_t i = (h >> 20) & mask;
    while (slots[i]) {
      const Entry& en = entries[slots[i] - 1];
      if (en.hash == h && en.klen == n && std::memcmp(keys.data() + en.koff, p, n) == 0) return;  // a racing put
      i = (i + 1) & mask;
    }
    entries.push_back(Entry{h, (uint32_t)keys.size(), (uint32_t)n, (uint32_t)vals.size(), (uint32_t)m});
    keys.insert(keys.end(), p, p + n);
    vals.insert(vals.end(), ids, ids + m);
    slots[i] = (uint32_t)entries.size();
  }
};

struct Scratch {  // per-thread working memory of the merge loop
  std::vector<uint32_t> ids, ranks;
  std::vector<int32_t> next, prev;
  std::vector<uint64_t> heap;
};

struct Encoder {
  int kind = GPT2;
  int32_t byte_ids[256];
  MergeTable table;
  std::vector<uint32_t> merged_by_rank;  // rank -> merged id
  std::vector<uint8_t> cats;             // code point -> kL | kN | kS (0x110000 entries)
  uint32_t fold_ascii[128];              // GPT-4 (?i): ASCII code point -> lower-case letter
  std::vector<std::pair<uint32_t, uint32_t>> folds;  // GPT-4 (?i): other code points -> contraction letter
  std::vector<std::pair<std::string, uint32_t>> specials;  // longest first
  bool special_first[256] = {};
  Shard shards[kShards];
  std::vector<PyObject*> ints;  // id -> a Python int, so building the output list allocates nothing

  // ------------------------------------------------------------------ pre-tokenizer
  inline uint32_t cp(const uint8_t* s, size_t i, size_t* len) const {  // s is valid UTF-8 (Python's encoder)
    uint8_t b = s[i];
    if (b < 0x80) {
      *len = 1;
      return b;
    }
    if (b < 0xE0) {
      *len = 2;
      return (uint32_t)(b & 0x1F) << 6 | (s[i + 1] & 0x3F);
    }
    if (b < 0xF0) {
      *len = 3;
      return (uint32_t)(b & 0x0F) << 12 | (uint32_t)(s[i + 1] & 0x3F) << 6 | (s[i + 2] & 0x3F);
    }
    *len = 4;
    return (uint32_t)(b & 0x07) << 18 | (uint32_t)(s[i + 1] & 0x3F) << 12 | (uint32_t)(s[i + 2] & 0x3F) << 6 |
           (s[i + 3] & 0x3F);
  }
  inline uint8_t cat(const uint8_t* s, size_t i, size_t* len) const { return cats[cp(s, i, len)]; }

  // end of the run of characters starting at i whose class intersects `mask` (mask 0: class 0)
  inline size_t run(const uint8_t* s, size_t n, size_t i, uint8_t mask) const {
    size_t len;
    if (mask == 0) {
      while (i < n && cat(s, i, &len) == 0) i += len;
    } else {
      while (i < n && (cat(s, i, &len) & mask)) i += len;
    }
    return i;
  }
  // whitespace run from i: its end; `last` = start of its last character, `count` = characters (capped at 2),
  // `nl` = the end of its last \r or \n (kNone if none)
  inline size_t space_run(const uint8_t* s, size_t n, size_t i, size_t* last, int* count, size_t* nl) const {
    size_t len;
    *count = 0;
    *nl = kNone;
    while (i < n && (cat(s, i, &len) & kS)) {
      *last = i;
      if (*count < 2) ++*count;
      if (s[i] == '\r' || s[i] == '\n') *nl = i + 1;
      i += len;
    }
    return i;
  }
  inline uint32_t fold(uint32_t c) const {  // the contraction letter c matches under (?i), or 0
    if (c < 128) return fold_ascii[c];
    for (const auto& f : folds)
      if (f.first == c) return f.second;
    return 0;
  }

  // GPT-2:  's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
  // SmolLM2: \p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+
  size_t piece_gpt2(const uint8_t* s, size_t n, size_t i, bool smollm) const {
    size_t l0;
    uint8_t k = cat(s, i, &l0);
    if (smollm && (k & kN)) return i + l0;
    if (s[i] == '\'' && i + 1 < n) {
      uint8_t a = s[i + 1];
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
      if (i + 2 < n) {
        uint8_t b = s[i + 2];
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
      }
    }
    if (s[i] == ' ' && i + 1 < n) {  // " ?X+": a space joins the run that follows it
      size_t l1;
      uint8_t k1 = cat(s, i + 1, &l1);
      if (k1 & kL) return run(s, n, i + 1, kL);
      if (!smollm && (k1 & kN)) return run(s, n, i + 1, kN);
      if (k1 == 0) return run(s, n, i + 1, 0);
    }
    if (k & kL) return run(s, n, i, kL);
    if (k & kN) return run(s, n, i, kN);
    if (k == 0) return run(s, n, i, 0);
    size_t last;
    int count;
    size_t nl;
    size_t j = space_run(s, n, i, &last, &count, &nl);
    if (j == n) return j;
    if (smollm) {  // (?![^\s\p{N}]): a run followed by a digit is whole
      size_t lj;
      if (cat(s, j, &lj) & kN) return j;
    }
    return count >= 2 ? last : j;  // \s+(?!\S) gives back the last character; a single one is \s+
  }

  // GPT-4:  (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
  //         \s*[\r\n]+|\s+(?!\S)|\s+        (Llama-3: the same, contractions case-insensitive in ASCII only)
  size_t piece_gpt4(const uint8_t* s, size_t n, size_t i) const {
    size_t l0;
    uint32_t c = cp(s, i, &l0);
    uint8_t k = cats[c];
    if (c == '\'' && i + 1 < n) {
      size_t l1;
      uint32_t a = fold(cp(s, i + 1, &l1));
      if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 1 + l1;
      if ((a == 'r' || a == 'v' || a == 'l') && i + 1 + l1 < n) {
        size_t l2;
        uint32_t b = fold(cp(s, i + 1 + l1, &l2));
        if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 1 + l1 + l2;
      }
    }
    if (k & kL) return run(s, n, i, kL);
    if (c != '\r' && c != '\n' && !(k & kN) && i + l0 < n) {  // [^\r\n\p{L}\p{N}]\p{L}+
      size_t l1;
      if (cat(s, i + l0, &l1) & kL) return run(s, n, i + l0, kL);
    }
    if (k & kN) {  // \p{N}{1,3}
      size_t j = i + l0, len;
      for (int r = 1; r < 3 && j < n && (cat(s, j, &len) & kN); ++r) j += len;
      return j;
    }
    size_t j = kNone;
    if (c == ' ' && i + 1 < n) {
      size_t l1;
      if (cat(s, i + 1, &l1) == 0) j = run(s, n, i + 1, 0);
    }
    if (j == kNone && k == 0) j = run(s, n, i, 0);
    if (j != kNone) {  // ... [\r\n]*
      while (j < n && (s[j] == '\r' || s[j] == '\n')) ++j;
      return j;
    }
    size_t last, nl;
    int count;
    j = space_run(s, n, i, &last, &count, &nl);
    if (nl != kNone) return nl;  // \s*[\r\n]+ backtracks to the run's last line break
    if (j == n) return j;
    return count >= 2 ? last : j;
  }

  inline size_t next_piece(const uint8_t* s, size_t n, size_t i) const {
    switch (kind) {
      case GPT2: return piece_gpt2(s, n, i, false);
      case SMOLLM: return piece_gpt2(s, n, i, true);
      default: return piece_gpt4(s, n, i);
    }
  }

  // ------------------------------------------------------------------ BPE
  void bpe(const uint8_t* p, size_t n, std::vector<uint32_t>& out, Scratch& sc) const {
    std::vector<uint32_t>& ids = sc.ids;
    ids.clear();
    for (size_t i = 0; i < n; ++i)
      if (byte_ids[p[i]] >= 0) ids.push_back((uint32_t)byte_ids[p[i]]);  // bytes the vocab lacks are dropped
    size_t m = ids.size();
    if (m < 2) {
      out.insert(out.end(), ids.begin(), ids.end());
      return;
    }
    if (m < kShortPiece) {
      std::vector<uint32_t>& ranks = sc.ranks;
      ranks.resize(m - 1);
      for (size_t i = 0; i + 1 < m; ++i) ranks[i] = table.rank(ids[i], ids[i + 1]);
      while (m > 1) {
        uint32_t best = kNoRank;
        size_t bi = 0;
        for (size_t i = 0; i + 1 < m; ++i)
          if (ranks[i] < best) {
            best = ranks[i];
            bi = i;
          }
        if (best == kNoRank) break;
        ids[bi] = merged_by_rank[best];
        ids.erase(ids.begin() + bi + 1);
        ranks.erase(ranks.begin() + bi);
        --m;
        if (bi > 0) ranks[bi - 1] = table.rank(ids[bi - 1], ids[bi]);
        if (bi + 1 < m) ranks[bi] = table.rank(ids[bi], ids[bi + 1]);
      }
      out.insert(out.end(), ids.begin(), ids.begin() + m);
      return;
    }
    // long piece: linked list + min-heap of (rank << 32 | position), stale entries skipped when popped
    std::vector<int32_t>& next = sc.next;
    std::vector<int32_t>& prev = sc.prev;
    std::vector<uint64_t>& heap = sc.heap;
    next.resize(m);
    prev.resize(m);
    heap.clear();
    auto push = [&](uint32_t r, size_t pos) {
      heap.push_back((uint64_t)r << 32 | pos);
      std::push_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
    };
    for (size_t i = 0; i < m; ++i) {
      next[i] = i + 1 < m ? (int32_t)(i + 1) : -1;
      prev[i] = (int32_t)i - 1;
      if (i + 1 < m) {
        uint32_t r = table.rank(ids[i], ids[i + 1]);
        if (r != kNoRank) push(r, i);
      }
    }
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<uint64_t>());
      uint64_t top = heap.back();
      heap.pop_back();
      uint32_t r = (uint32_t)(top >> 32);
      size_t pos = (size_t)(top & 0xFFFFFFFFu);
      if (ids[pos] == kDead) continue;
      int32_t nx = next[pos];
      if (nx < 0 || table.rank(ids[pos], ids[nx]) != r) continue;  // stale: the pair changed since the push
      ids[pos] = merged_by_rank[r];
      int32_t nn = next[nx];
      next[pos] = nn;
      if (nn >= 0) prev[nn] = (int32_t)pos;
      ids[nx] = kDead;
      if (prev[pos] >= 0) {
        uint32_t r2 = table.rank(ids[prev[pos]], ids[pos]);
        if (r2 != kNoRank) push(r2, (size_t)prev[pos]);
      }
      if (nn >= 0) {
        uint32_t r3 = table.rank(ids[pos], ids[nn]);
        if (r3 != kNoRank) push(r3, pos);
      }
    }
    for (int32_t i = 0; i >= 0; i = next[i]) out.push_back(ids[i]);
  }

  // one pre-token -> ids (cached)
  inline void piece(const uint8_t* p, size_t n, std::vector<uint32_t>& out, Scratch& sc) {
    if (n == 1) {
      if (byte_ids[p[0]] >= 0) out.push_back((uint32_t)byte_ids[p[0]]);
      return;
    }
    if (n > kMaxCachedPiece) {
      bpe(p, n, out, sc);
      return;
    }
    uint64_t h = hash_bytes(p, n);
    Shard& sh = shards[h & (kShards - 1)];
    {
      std::lock_guard<std::mutex> lock(sh.mu);
      if (sh.get(h, p, n, out)) return;
    }
    size_t start = out.size();
    bpe(p, n, out, sc);
    std::lock_guard<std::mutex> lock(sh.mu);
    sh.put(h, p, n, out.data() + start, out.size() - start);
  }

  void ordinary(const uint8_t* s, size_t n, std::vector<uint32_t>& out, Scratch& sc) {
    for (size_t i = 0; i < n;) {
      size_t j = next_piece(s, n, i);
      piece(s + i, j - i, out, sc);
      i = j;
    }
  }

  // text -> ids: specials cut out (at each position the longest special that matches), the rest pre-tokenized
  void encode(const uint8_t* s, size_t n, bool allow_special, std::vector<uint32_t>& out, Scratch& sc) {
    if (!allow_special || specials.empty()) {
      ordinary(s, n, out, sc);
      return;
    }
    size_t seg = 0;
    for (size_t i = 0; i < n;) {
      if (!special_first[s[i]]) {
        ++i;
        continue;
      }
      const std::pair<std::string, uint32_t>* hit = nullptr;
      for (const auto& sp : specials)
        if (sp.first.size() <= n - i && std::memcmp(s + i, sp.first.data(), sp.first.size()) == 0) {
          hit = &sp;
          break;
        }
      if (hit == nullptr) {
        ++i;
        continue;
      }
      ordinary(s + seg, i - seg, out, sc);
      out.push_back(hit->second);
      i += hit->first.size();
      seg = i;
    }
    ordinary(s + seg, n - seg, out, sc);
  }

  void clear_cache() {
    for (Shard& sh : shards) {
      std::lock_guard<std::mutex> lock(sh.mu);
      sh.clear();
    }
  }
  size_t cache_len() {
    size_t total = 0;
    for (Shard& sh : shards) {
      std::lock_guard<std::mutex> lock(sh.mu);
      total += sh.entries.size();
    }
    return total;
  }
};

// ---------------------------------------------------------------------- Python glue
const char* kCapsule = "lmstack.tokenizer.bpe.Encoder";

void encoder_free(PyObject* cap) {
  Encoder* e = (Encoder*)PyCapsule_GetPointer(cap, kCapsule);
  if (e == nullptr) return;
  for (PyObject* o : e->ints) Py_XDECREF(o);
  delete e;
}

Encoder* get_encoder(PyObject* cap) { return (Encoder*)PyCapsule_GetPointer(cap, kCapsule); }

// The encoder, if it pre-tokenizes itself (a built-in pattern); custom patterns only take encode_pieces.
Encoder* get_splitting_encoder(PyObject* cap) {
  Encoder* e = get_encoder(cap);
  if (e != nullptr && e->kind == CUSTOM) {
    PyErr_SetString(PyExc_ValueError, "this encoder has a custom pattern: split in Python, then encode_pieces");
    return nullptr;
  }
  return e;
}

bool buffer_of(PyObject* o, Py_buffer* view, Py_ssize_t itemsize, const char* what) {
  if (PyObject_GetBuffer(o, view, PyBUF_SIMPLE) < 0) return false;
  if (view->len % itemsize) {
    PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a multiple of %zd", what, view->len, itemsize);
    PyBuffer_Release(view);
    return false;
  }
  return true;
}

// new(byte_ids: 256 int32, merges: (left, right, rank, merged) uint32 quads, n_ranks, cats: 0x110000 bytes,
//     kind, folds: (code point, letter) uint32 pairs, specials: list[(bytes, id)], cache_size, max_id) -> capsule
PyObject* py_new(PyObject*, PyObject* args) {
  PyObject *byte_ids, *merges, *cats, *folds, *specials;
  Py_ssize_t n_ranks, cache_size, max_id;
  int kind;
  if (!PyArg_ParseTuple(args, "OOnOiOO!nn", &byte_ids, &merges, &n_ranks, &cats, &kind, &folds, &PyList_Type,
                        &specials, &cache_size, &max_id))
    return nullptr;
  Encoder* e = nullptr;
  Py_buffer vb{}, vm{}, vc{}, vf{};
  bool ok = false;
  try {
    e = new Encoder();
    e->kind = kind;
    if (!buffer_of(byte_ids, &vb, 4, "byte_ids")) goto done;
    if (!buffer_of(merges, &vm, 16, "merges")) goto done;
    if (!buffer_of(cats, &vc, 1, "cats")) goto done;
    if (!buffer_of(folds, &vf, 8, "folds")) goto done;
    if (vb.len != 256 * 4 || vc.len != 0x110000) {
      PyErr_SetString(PyExc_ValueError, "byte_ids must hold 256 int32 and cats 0x110000 bytes");
      goto done;
    }
    std::memcpy(e->byte_ids, vb.buf, sizeof(e->byte_ids));
    {
      const uint32_t* q = (const uint32_t*)vm.buf;
      size_t nm = vm.len / 16;
      e->table.init(nm);
      e->merged_by_rank.assign((size_t)std::max<Py_ssize_t>(n_ranks, 0), 0);
      for (size_t k = 0; k < nm; ++k) {
        if (q[4 * k + 2] >= e->merged_by_rank.size()) {
          PyErr_SetString(PyExc_ValueError, "merge rank out of range");
          goto done;
        }
        e->table.insert(q[4 * k], q[4 * k + 1], q[4 * k + 2], q[4 * k + 3]);
        e->merged_by_rank[q[4 * k + 2]] = q[4 * k + 3];
      }
    }
    e->cats.assign((const uint8_t*)vc.buf, (const uint8_t*)vc.buf + vc.len);
    std::memset(e->fold_ascii, 0, sizeof(e->fold_ascii));
    {
      const uint32_t* f = (const uint32_t*)vf.buf;
      for (Py_ssize_t k = 0; k < vf.len / 8; ++k) {
        if (f[2 * k] < 128)
          e->fold_ascii[f[2 * k]] = f[2 * k + 1];
        else
          e->folds.emplace_back(f[2 * k], f[2 * k + 1]);
      }
    }
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(specials); ++k) {
      PyObject* item = PyList_GET_ITEM(specials, k);
      const char* b;
      Py_ssize_t blen;
      unsigned int id;
      if (!PyArg_ParseTuple(item, "y#I", &b, &blen, &id)) goto done;
      if (blen == 0) {
        PyErr_SetString(PyExc_ValueError, "special tokens must be non-empty");
        goto done;
      }
      e->specials.emplace_back(std::string(b, (size_t)blen), id);
      e->special_first[(uint8_t)b[0]] = true;
    }
    std::stable_sort(e->specials.begin(), e->specials.end(),
                     [](const auto& a, const auto& b) { return a.first.size() > b.first.size(); });
    // (at most 2^22 pieces a shard: its arenas of <= 256-byte keys stay within 32-bit offsets)
    size_t per_shard = std::min<size_t>(1u << 22, std::max<size_t>(1, (size_t)std::max<Py_ssize_t>(cache_size, 1) / kShards));
    for (Shard& sh : e->shards) {
      sh.limit = per_shard;
      sh.clear();
    }
    max_id = std::min<Py_ssize_t>(max_id, (1 << 20) - 1);  // larger ids (sparse vocabularies) get new ints
    e->ints.assign((size_t)max_id + 1, nullptr);
    for (Py_ssize_t i = 0; i <= max_id; ++i) {
      e->ints[i] = PyLong_FromSsize_t(i);
      if (e->ints[i] == nullptr) goto done;
    }
    ok = true;
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  }
done:
  if (vb.obj) PyBuffer_Release(&vb);
  if (vm.obj) PyBuffer_Release(&vm);
  if (vc.obj) PyBuffer_Release(&vc);
  if (vf.obj) PyBuffer_Release(&vf);
  if (!ok) {
    if (e) {
      for (PyObject* o : e->ints) Py_XDECREF(o);
      delete e;
    }
    return nullptr;
  }
  PyObject* cap = PyCapsule_New(e, kCapsule, encoder_free);
  if (cap == nullptr) {
    for (PyObject* o : e->ints) Py_XDECREF(o);
    delete e;
  }
  return cap;
}

// A str's UTF-8 bytes, borrowed from the str when it is ASCII, else from a new bytes object held in `keep`.
// Lone surrogates raise UnicodeEncodeError, as str.encode("utf-8") does in the Python path.
bool utf8_of(PyObject* text, const uint8_t** data, size_t* len, PyObject** keep) {
  *keep = nullptr;
  if (!PyUnicode_Check(text)) {
    PyErr_Format(PyExc_TypeError, "encode expects str, got %s", Py_TYPE(text)->tp_name);
    return false;
  }
  if (PyUnicode_IS_ASCII(text)) {
    *data = (const uint8_t*)PyUnicode_DATA(text);
    *len = (size_t)PyUnicode_GET_LENGTH(text);
    return true;
  }
  *keep = PyUnicode_AsUTF8String(text);
  if (*keep == nullptr) return false;
  *data = (const uint8_t*)PyBytes_AS_STRING(*keep);
  *len = (size_t)PyBytes_GET_SIZE(*keep);
  return true;
}

PyObject* id_list(Encoder* e, const std::vector<uint32_t>& ids) {
  PyObject* list = PyList_New((Py_ssize_t)ids.size());
  if (list == nullptr) return nullptr;
  for (size_t i = 0; i < ids.size(); ++i) {
    PyObject* o = ids[i] < e->ints.size() ? e->ints[ids[i]] : nullptr;
    if (o != nullptr) {
      Py_INCREF(o);
    } else {
      o = PyLong_FromUnsignedLong(ids[i]);
      if (o == nullptr) {
        Py_DECREF(list);
        return nullptr;
      }
    }
    PyList_SET_ITEM(list, (Py_ssize_t)i, o);
  }
  return list;
}

// encode(enc, text, allow_special) -> list[int]
PyObject* py_encode(PyObject*, PyObject* args) {
  PyObject *cap, *text;
  int allow_special;
  if (!PyArg_ParseTuple(args, "OOp", &cap, &text, &allow_special)) return nullptr;
  Encoder* e = get_splitting_encoder(cap);
  if (e == nullptr) return nullptr;
  const uint8_t* s;
  size_t n;
  PyObject* keep;
  if (!utf8_of(text, &s, &n, &keep)) return nullptr;
  std::vector<uint32_t> out;
  bool oom = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    Scratch sc;
    out.reserve(n / 3 + 16);
    e->encode(s, n, allow_special != 0, out, sc);
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  Py_END_ALLOW_THREADS
  Py_XDECREF(keep);
  if (oom) return PyErr_NoMemory();
  return id_list(e, out);
}

// encode_pieces(enc, pieces: list[str]) -> list[int]: BPE of pre-tokens split by Python (custom patterns)
PyObject* py_encode_pieces(PyObject*, PyObject* args) {
  PyObject *cap, *pieces;
  if (!PyArg_ParseTuple(args, "OO!", &cap, &PyList_Type, &pieces)) return nullptr;
  Encoder* e = get_encoder(cap);
  if (e == nullptr) return nullptr;
  std::vector<uint32_t> out;
  try {
    Scratch sc;
    for (Py_ssize_t k = 0; k < PyList_GET_SIZE(pieces); ++k) {
      const uint8_t* s;
      size_t n;
      PyObject* keep;
      if (!utf8_of(PyList_GET_ITEM(pieces, k), &s, &n, &keep)) return nullptr;
      if (n) e->piece(s, n, out, sc);
      Py_XDECREF(keep);
    }
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  }
  return id_list(e, out);
}

// Encodes texts[k] into outs[k] on `threads` threads (GIL released by the caller); false when out of memory.
bool encode_many(Encoder* e, const std::vector<std::pair<const uint8_t*, size_t>>& texts, bool allow_special,
                 int threads, std::vector<std::vector<uint32_t>>& outs) {
  std::atomic<size_t> next{0};
  std::atomic<bool> oom{false};
  auto work = [&]() {
    try {
      Scratch sc;
      for (size_t k; (k = next.fetch_add(1)) < texts.size();) {
        outs[k].reserve(texts[k].second / 3 + 16);
        e->encode(texts[k].first, texts[k].second, allow_special, outs[k], sc);
      }
    } catch (const std::bad_alloc&) {
      oom = true;
    }
  };
  threads = (int)std::max<size_t>(1, std::min<size_t>((size_t)std::max(threads, 1), texts.size()));
  std::vector<std::thread> pool;
  try {
    for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  } catch (const std::exception&) {  // could not start a thread: the ones started and this one do the work
  }
  work();
  for (std::thread& t : pool) t.join();
  return !oom;
}

// The UTF-8 of every str in `texts`; `keeps` holds a reference to each str and each bytes copy, so that
// another thread changing the list while the GIL is released frees nothing being read.
bool collect_texts(PyObject* texts, std::vector<std::pair<const uint8_t*, size_t>>& views,
                   std::vector<PyObject*>& keeps) {
  Py_ssize_t n = PyList_GET_SIZE(texts);
  views.reserve((size_t)n);
  keeps.reserve(2 * (size_t)n);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* item = PyList_GET_ITEM(texts, k);
    const uint8_t* s;
    size_t len;
    PyObject* keep;
    if (!utf8_of(item, &s, &len, &keep)) return false;
    Py_INCREF(item);
    keeps.push_back(item);
    if (keep) keeps.push_back(keep);
    views.emplace_back(s, len);
  }
  return true;
}

void release(std::vector<PyObject*>& keeps) {
  for (PyObject* o : keeps) Py_DECREF(o);
  keeps.clear();
}

// encode_batch(enc, texts: list[str], allow_special, num_threads) -> list[list[int]]
PyObject* py_encode_batch(PyObject*, PyObject* args) {
  PyObject *cap, *texts;
  int allow_special, threads;
  if (!PyArg_ParseTuple(args, "OO!pi", &cap, &PyList_Type, &texts, &allow_special, &threads)) return nullptr;
  Encoder* e = get_splitting_encoder(cap);
  if (e == nullptr) return nullptr;
  std::vector<std::pair<const uint8_t*, size_t>> views;
  std::vector<PyObject*> keeps;
  std::vector<std::vector<uint32_t>> outs;
  bool ok = false;
  try {
    if (!collect_texts(texts, views, keeps)) {
      release(keeps);
      return nullptr;
    }
    outs.resize(views.size());
    Py_BEGIN_ALLOW_THREADS
    ok = encode_many(e, views, allow_special != 0, threads, outs);
    Py_END_ALLOW_THREADS
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  release(keeps);
  if (!ok) return PyErr_NoMemory();
  PyObject* result = PyList_New((Py_ssize_t)outs.size());
  if (result == nullptr) return nullptr;
  for (size_t k = 0; k < outs.size(); ++k) {
    PyObject* list = id_list(e, outs[k]);
    if (list == nullptr) {
      Py_DECREF(result);
      return nullptr;
    }
    PyList_SET_ITEM(result, (Py_ssize_t)k, list);
    std::vector<uint32_t>().swap(outs[k]);
  }
  return result;
}

// encode_join(enc, texts, allow_special, num_threads, itemsize, sep) -> bytes: the ids of every text, each
// followed by `sep` (an EOS id; -1: none), as native-endian uint16 (itemsize 2) or uint32 (itemsize 4) --
// a token file's contents without a Python int per token.
PyObject* py_encode_join(PyObject*, PyObject* args) {
  PyObject *cap, *texts;
  int allow_special, threads, itemsize;
  long long sep;
  if (!PyArg_ParseTuple(args, "OO!piiL", &cap, &PyList_Type, &texts, &allow_special, &threads, &itemsize, &sep))
    return nullptr;
  Encoder* e = get_splitting_encoder(cap);
  if (e == nullptr) return nullptr;
  if (itemsize != 2 && itemsize != 4) {
    PyErr_Format(PyExc_ValueError, "itemsize=%d must be 2 (uint16) or 4 (uint32)", itemsize);
    return nullptr;
  }
  std::vector<std::pair<const uint8_t*, size_t>> views;
  std::vector<PyObject*> keeps;
  std::vector<std::vector<uint32_t>> outs;
  bool ok = false;
  try {
    if (!collect_texts(texts, views, keeps)) {
      release(keeps);
      return nullptr;
    }
    outs.resize(views.size());
    Py_BEGIN_ALLOW_THREADS
    ok = encode_many(e, views, allow_special != 0, threads, outs);
    Py_END_ALLOW_THREADS
  } catch (const std::bad_alloc&) {
    ok = false;
  }
  release(keeps);
  if (!ok) return PyErr_NoMemory();
  size_t total = 0;
  uint32_t limit = itemsize == 2 ? 0xFFFFu : 0xFFFFFFFFu;
  for (const auto& o : outs) {
    total += o.size() + (sep >= 0 ? 1 : 0);
    for (uint32_t id : o)
      if (id > limit) {
        PyErr_Format(PyExc_ValueError, "token id %u does not fit in uint%d", id, 8 * itemsize);
        return nullptr;
      }
  }
  PyObject* result = PyBytes_FromStringAndSize(nullptr, (Py_ssize_t)(total * (size_t)itemsize));
  if (result == nullptr) return nullptr;
  char* dst = PyBytes_AS_STRING(result);
  for (const auto& o : outs) {
    if (itemsize == 4) {
      std::memcpy(dst, o.data(), o.size() * 4);
      dst += o.size() * 4;
      if (sep >= 0) {
        uint32_t v = (uint32_t)sep;
        std::memcpy(dst, &v, 4);
        dst += 4;
      }
    } else {
      for (uint32_t id : o) {
        uint16_t v = (uint16_t)id;
        std::memcpy(dst, &v, 2);
        dst += 2;
      }
      if (sep >= 0) {
        uint16_t v = (uint16_t)sep;
        std::memcpy(dst, &v, 2);
        dst += 2;
      }
    }
  }
  return result;
}

PyObject* py_clear_cache(PyObject*, PyObject* args) {
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "O", &cap)) return nullptr;
  Encoder* e = get_encoder(cap);
  if (e == nullptr) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  e->clear_cache();
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

PyObject* py_cache_len(PyObject*, PyObject* args) {
  PyObject* cap;
  if (!PyArg_ParseTuple(args, "O", &cap)) return nullptr;
  Encoder* e = get_encoder(cap);
  if (e == nullptr) return nullptr;
  return PyLong_FromSize_t(e->cache_len());
}

// encode_prefix(enc, text) -> (ids, k): the ids of every pre-token of special-free `text` but the last, and
// the last one's length in characters (encode_iterable holds it back: more text may extend it)
PyObject* py_encode_prefix(PyObject*, PyObject* args) {
  PyObject *cap, *text;
  if (!PyArg_ParseTuple(args, "OO", &cap, &text)) return nullptr;
  Encoder* e = get_splitting_encoder(cap);
  if (e == nullptr) return nullptr;
  const uint8_t* s;
  size_t n;
  PyObject* keep;
  if (!utf8_of(text, &s, &n, &keep)) return nullptr;
  std::vector<uint32_t> out;
  Py_ssize_t last_chars = 0;
  bool oom = false;
  Py_BEGIN_ALLOW_THREADS
  try {
    Scratch sc;
    size_t i = 0;
    while (i < n) {
      size_t j = e->next_piece(s, n, i);
      if (j == n) {
        for (size_t b = i; b < n; ++b) last_chars += (s[b] & 0xC0) != 0x80;
      } else {
        e->piece(s + i, j - i, out, sc);
      }
      i = j;
    }
  } catch (const std::bad_alloc&) {
    oom = true;
  }
  Py_END_ALLOW_THREADS
  Py_XDECREF(keep);
  if (oom) return PyErr_NoMemory();
  PyObject* ids = id_list(e, out);
  if (ids == nullptr) return nullptr;
  return Py_BuildValue("(Nn)", ids, last_chars);
}

// pretokenize(enc, text) -> list[str]: the pre-tokens of special-free text (for tests against `regex`)
PyObject* py_pretokenize(PyObject*, PyObject* args) {
  PyObject *cap, *text;
  if (!PyArg_ParseTuple(args, "OO", &cap, &text)) return nullptr;
  Encoder* e = get_splitting_encoder(cap);
  if (e == nullptr) return nullptr;
  const uint8_t* s;
  size_t n;
  PyObject* keep;
  if (!utf8_of(text, &s, &n, &keep)) return nullptr;
  PyObject* list = PyList_New(0);
  for (size_t i = 0; list != nullptr && i < n;) {
    size_t j = e->next_piece(s, n, i);
    PyObject* piece = PyUnicode_DecodeUTF8((const char*)s + i, (Py_ssize_t)(j - i), "strict");
    if (piece == nullptr || PyList_Append(list, piece) < 0) Py_CLEAR(list);
    Py_XDECREF(piece);
    i = j;
  }
  Py_XDECREF(keep);
  return list;
}

PyMethodDef kMethods[] = {
    {"new", py_new, METH_VARARGS, "new(byte_ids, merges, n_ranks, cats, kind, folds, specials, cache_size, max_id)"},
    {"encode", py_encode, METH_VARARGS, "encode(enc, text, allow_special) -> list[int]"},
    {"encode_pieces", py_encode_pieces, METH_VARARGS, "encode_pieces(enc, pieces) -> list[int]"},
    {"encode_batch", py_encode_batch, METH_VARARGS, "encode_batch(enc, texts, allow_special, threads)"},
    {"encode_join", py_encode_join, METH_VARARGS, "encode_join(enc, texts, allow_special, threads, itemsize, sep)"},
    {"clear_cache", py_clear_cache, METH_VARARGS, "clear_cache(enc)"},
    {"cache_len", py_cache_len, METH_VARARGS, "cache_len(enc) -> cached pieces"},
    {"encode_prefix", py_encode_prefix, METH_VARARGS, "encode_prefix(enc, text) -> (ids, last piece's length)"},
    {"pretokenize", py_pretokenize, METH_VARARGS, "pretokenize(enc, text) -> list[str]"},
    {nullptr, nullptr, 0, nullptr}};

#define LMSTACK_STR2(x) #x
#define LMSTACK_STR(x) LMSTACK_STR2(x)
#define LMSTACK_CAT2(a, b) a##b
#define LMSTACK_CAT(a, b) LMSTACK_CAT2(a, b)

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, LMSTACK_STR(TORCH_EXTENSION_NAME), "lmstack BPE encoder core", -1,
                       kMethods};

}  // namespace

PyMODINIT_FUNC LMSTACK_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&kModule); }
