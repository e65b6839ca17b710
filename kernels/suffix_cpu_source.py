"""The C++ of the compiled suffix proposer (`npuspec.kernels.suffix_cpu` loads it).

A line-by-line port of `npuspec.spec_decode.suffix_reference.SuffixProposerReference` (read its module
docstring first: the algorithm, the tie-breaks, the search windows and the work budget are
documented there, and every choice below mirrors one there). What the port has to keep, since
the drafts and probabilities must be bitwise equal to the reference's:

* insertion order: a trie node's children form a list in first-seen order (a child deleted at
  count 0 and created again goes to the end), so "the first maximum in first-seen order" after
  an eviction picks what Python's `max(dict)` picks; occurrence lists are oldest first and a
  window reads their last `window` entries, evicted ones included until `_compact`;
* a node that reaches count 0 is unlinked at once but freed only at the end of `remove_seq`:
  its children, decremented at the next positions of the same sequence, are reached through
  it, as Python reaches them through the detached dict; a depth-3 node created again starts a
  new occurrence list;
* float arithmetic in Python's order: need = int(m * f + off + 1e-6) with every step rounded
  (`volatile`, so no FMA contraction), p = c / denom as one IEEE division, scores summed left
  to right (or with Neumaier's compensation, as CPython >= 3.12's sum() does);
* sequence slots (Python's sids): a slot whose sequence had tokens is reused only after the
  next compaction, which drops every reference to it, so "is this ref's sequence alive" is one
  array read instead of Python's dict lookup, with the same answer.
"""

SOURCE = r"""
#include <torch/csrc/inductor/cpp_prefix.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

// Reassociating or reciprocal math would change the scores' last bits: refuse to build, so
// the caller falls back to the Python reference (logged) instead of drafting differently.
#if defined(__FAST_MATH__) || defined(__ASSOCIATIVE_MATH__) || defined(__RECIPROCAL_MATH__)
#error "the suffix proposer must round like Python: build without -funsafe-math-optimizations"
#endif

namespace {
constexpr uint32_t kNil = 0xFFFFFFFFu;
constexpr int kH = 4;     // count trie over strings of 1..kH tokens (Python's _H)
constexpr int kLong = 8;  // the long occurrence index (Python's _LONG)

struct Ref { uint32_t seq, e; };  // sequence slot, position of the string's last token
inline bool operator==(Ref a, Ref b) { return a.seq == b.seq && a.e == b.e; }

inline uint64_t fib(uint64_t x) { return x * 0x9E3779B97F4A7C15ull; }

// (parent node << 32 | token) -> child node: linear probing, backward-shift erase
class KidMap {
 public:
  KidMap() { rehash(16); }
  uint32_t find(uint64_t k) const {
    for (size_t i = home(k);; i = (i + 1) & mask_) {
      if (slots_[i].key == k) return slots_[i].val;
      if (slots_[i].key == kEmpty) return kNil;
    }
  }
  void insert(uint64_t k, uint32_t v) {  // k is absent
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * slots_.size());
    size_t i = home(k);
    while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
    slots_[i] = {k, v};
    ++size_;
  }
  void erase(uint64_t k) {
    size_t i = home(k);
    while (slots_[i].key != k) i = (i + 1) & mask_;
    for (size_t j = i;;) {
      j = (j + 1) & mask_;
      if (slots_[j].key == kEmpty) break;
      const size_t h = home(slots_[j].key);
      const bool stays = i <= j ? (i < h && h <= j) : (i < h || h <= j);
      if (!stays) {
        slots_[i] = slots_[j];
        i = j;
      }
    }
    slots_[i].key = kEmpty;
    --size_;
  }
  void reserve(size_t n) {
    size_t cap = slots_.size();
    while (cap < 2 * n) cap *= 2;
    if (cap != slots_.size()) rehash(cap);
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;  // no node has id kNil
  struct Slot { uint64_t key; uint32_t val; };
  size_t home(uint64_t k) const { return fib(k) >> shift_; }
  void rehash(size_t cap) {
    std::vector<Slot> old;
    old.swap(slots_);
    slots_.assign(cap, Slot{kEmpty, 0});
    mask_ = cap - 1;
    shift_ = 64 - __builtin_ctzll(cap);
    for (const Slot& s : old) {
      if (s.key == kEmpty) continue;
      size_t i = home(s.key);
      while (slots_[i].key != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }
  std::vector<Slot> slots_;
  size_t mask_ = 0, size_ = 0;
  int shift_ = 0;
};

// 8-token string -> occurrence list id; entries are only dropped by a rebuild (compaction)
class GramMap {
 public:
  GramMap() { table_.assign(16, kNil); }
  uint32_t find(const uint32_t* t) const {
    const uint64_t h = hash(t);
    for (size_t i = h >> shift_;; i = (i + 1) & (table_.size() - 1)) {
      const uint32_t x = table_[i];
      if (x == kNil) return kNil;
      if (std::memcmp(entries_[x].k, t, sizeof(entries_[x].k)) == 0) return entries_[x].list;
    }
  }
  void insert(const uint32_t* t, uint32_t list) {  // t is absent
    if (2 * (entries_.size() + 1) > table_.size()) grow(2 * table_.size());
    Entry e;
    std::memcpy(e.k, t, sizeof(e.k));
    e.list = list;
    entries_.push_back(e);
    place(entries_.size() - 1);
  }
  template <class Keep>  // keep(list) -> false drops the entry
  void rebuild(Keep keep) {
    size_t n = 0;
    for (const Entry& e : entries_)
      if (keep(e.list)) entries_[n++] = e;
    entries_.resize(n);
    size_t cap = 16;
    while (cap < 2 * n + 2) cap *= 2;
    grow(cap);
  }
  void reserve(size_t n) {
    entries_.reserve(n);
    size_t cap = table_.size();
    while (cap < 2 * n) cap *= 2;
    if (cap != table_.size()) grow(cap);
  }

 private:
  struct Entry { uint32_t k[kLong]; uint32_t list; };
  static uint64_t hash(const uint32_t* t) {
    uint64_t h = 0;
    for (int i = 0; i < kLong; i += 2) {
      h = fib(h ^ (uint64_t(t[i]) << 32 | t[i + 1]));
      h ^= h >> 29;
    }
    return fib(h);
  }
  void place(uint32_t x) {
    size_t i = hash(entries_[x].k) >> shift_;
    while (table_[i] != kNil) i = (i + 1) & (table_.size() - 1);
    table_[i] = x;
  }
  void grow(size_t cap) {
    table_.assign(cap, kNil);
    shift_ = 64 - __builtin_ctzll(cap);
    for (uint32_t x = 0; x < entries_.size(); ++x) place(x);
  }
  std::vector<Entry> entries_;
  std::vector<uint32_t> table_;
  int shift_ = 60;
};

// A trie node: count, its token, the child that reached the top count first (kNil: none),
// the children in first-seen order (first/last, and prev/next among siblings), and at depth
// 3 the id of its occurrence list.
struct Node { uint32_t count, tok, best, first, last, prev, next, list; };

struct Seq {
  std::vector<uint32_t> toks;
  uint32_t tail[kH];  // trie nodes of the last 0..kH-1 tokens
  uint32_t owner;     // the running request whose response this is (kNil: none)
  bool alive;
};

class Tree {
 public:
  std::vector<Node> nodes;
  std::vector<Seq> seqs;
  int64_t n_alive = 0;
  int64_t compact_min = 0;  // Python's _COMPACT_MIN (global tree only)

  Tree() { nodes.push_back(Node{0, 0, kNil, kNil, kNil, kNil, kNil, kNil}); }  // root

  // sized for text: a 4096-token prompt of the shipped traces has ~7.5K distinct 1..4-token
  // strings and ~5.6K occurrence lists (reserving for the worst case, 4 strings and 2 lists
  // per token, doubled the memory of a request)
  void reserve(size_t tokens) {
    nodes.reserve(2 * tokens + 16);
    kids_.reserve(2 * tokens + 16);
    lists_.reserve(3 * tokens / 2 + 16);
    grams_.reserve(tokens);
  }
  uint32_t child(uint32_t parent, uint32_t t) const { return kids_.find(uint64_t(parent) << 32 | t); }
  const std::vector<Ref>* trigram(const uint32_t* t) const {
    uint32_t n = 0;
    for (int j = 0; j < 3 && n != kNil; ++j) n = child(n, t[j]);
    return n == kNil ? nullptr : &lists_[nodes[n].list];
  }
  const std::vector<Ref>* gram8(const uint32_t* t) const {
    const uint32_t l = grams_.find(t);
    return l == kNil ? nullptr : &lists_[l];
  }

  uint32_t add_seq(uint32_t owner) {
    uint32_t s;
    if (!free_seqs_.empty()) {
      s = free_seqs_.back();
      free_seqs_.pop_back();
    } else {
      s = seqs.size();
      seqs.emplace_back();
    }
    Seq& q = seqs[s];
    q.toks.clear();
    std::fill(q.tail, q.tail + kH, 0u);
    q.owner = owner;
    q.alive = true;
    ++n_alive;
    return s;
  }

  void append(uint32_t s, const uint32_t* t, int64_t n) {
    live_ += n;
    for (int64_t i = 0; i < n; ++i) append_one(s, t[i]);
  }

  // Undo the sequence's counts exactly (Python's remove_seq), then maybe compact.
  void remove_seq(uint32_t s) {
    Seq& q = seqs[s];
    uint32_t tl[kH] = {0, 0, 0, 0};
    zeroed_.clear();
    for (size_t e = 0; e < q.toks.size(); ++e) {
      const uint32_t t = q.toks[e];
      const int top = e + 1 < kH ? int(e + 1) : kH;
      uint32_t cur[kH] = {0, 0, 0, 0};
      for (int j = 0; j < top; ++j) {
        const uint32_t parent = tl[j];
        const uint64_t key = uint64_t(parent) << 32 | t;
        const uint32_t node = kids_.find(key);
        if (--nodes[node].count == 0) {
          kids_.erase(key);
          unlink(parent, node);
          zeroed_.push_back(node);
        }
        const uint32_t b = nodes[parent].best;
        if (b != kNil && nodes[b].tok == t) repick(parent);
        if (j + 1 < kH) cur[j + 1] = node;
      }
      std::copy(cur, cur + kH, tl);
    }
    for (uint32_t z : zeroed_) free_node(z);
    const int64_t len = q.toks.size();
    live_ -= len;
    dead_ += len;
    q.alive = false;
    q.owner = kNil;
    --n_alive;
    if (len == 0) free_seqs_.push_back(s);  // nothing refers to it
    else pending_.push_back(s);
    std::vector<uint32_t>().swap(q.toks);
    if (dead_ > std::max(live_, compact_min)) compact();
  }

 private:
  KidMap kids_;
  GramMap grams_;
  std::vector<std::vector<Ref>> lists_;
  std::vector<uint32_t> free_nodes_, free_lists_, free_seqs_, pending_, zeroed_;
  int64_t live_ = 0, dead_ = 0;

  uint32_t new_list() {
    if (!free_lists_.empty()) {
      const uint32_t l = free_lists_.back();
      free_lists_.pop_back();
      return l;
    }
    lists_.emplace_back();
    return lists_.size() - 1;
  }
  void free_list(uint32_t l) {
    if (lists_[l].capacity() > 16) std::vector<Ref>().swap(lists_[l]);
    else lists_[l].clear();
    free_lists_.push_back(l);
  }
  uint32_t new_node(uint32_t parent, uint32_t t, bool with_list) {
    const uint32_t l = with_list ? new_list() : kNil;
    uint32_t n;
    if (!free_nodes_.empty()) {
      n = free_nodes_.back();
      free_nodes_.pop_back();
    } else {
      n = nodes.size();
      nodes.emplace_back();
    }
    nodes[n] = Node{1, t, kNil, kNil, kNil, nodes[parent].last, kNil, l};
    if (nodes[parent].last == kNil) nodes[parent].first = n;
    else nodes[nodes[parent].last].next = n;
    nodes[parent].last = n;
    kids_.insert(uint64_t(parent) << 32 | t, n);
    return n;
  }
  void free_node(uint32_t n) {
    if (nodes[n].list != kNil) free_list(nodes[n].list);
    nodes[n].list = kNil;  // compact() walks every node's list
    free_nodes_.push_back(n);
  }
  void unlink(uint32_t parent, uint32_t n) {
    Node& x = nodes[n];
    if (x.prev == kNil) nodes[parent].first = x.next;
    else nodes[x.prev].next = x.next;
    if (x.next == kNil) nodes[parent].last = x.prev;
    else nodes[x.next].prev = x.prev;
  }
  void repick(uint32_t parent) {  // the first maximum in first-seen order
    uint32_t b = kNil, c = 0;
    for (uint32_t x = nodes[parent].first; x != kNil; x = nodes[x].next)
      if (b == kNil || nodes[x].count > c) {
        b = x;
        c = nodes[x].count;
      }
    nodes[parent].best = b;
  }

  void append_one(uint32_t s, uint32_t t) {
    Seq& q = seqs[s];
    const uint32_t e = q.toks.size();
    q.toks.push_back(t);
    const int top = e + 1 < kH ? int(e + 1) : kH;
    uint32_t cur[kH] = {0, 0, 0, 0};
    for (int j = 0; j < top; ++j) {
      const uint32_t parent = q.tail[j];
      uint32_t node = child(parent, t);
      if (node == kNil) {
        node = new_node(parent, t, j == kH - 2);
      } else {
        ++nodes[node].count;
      }
      if (j == kH - 2) lists_[nodes[node].list].push_back(Ref{s, e});
      // the first token to reach the top count keeps it: replace only on a larger count
      Node& p = nodes[parent];
      if (p.best == kNil || (nodes[p.best].tok != t && nodes[node].count > nodes[p.best].count))
        p.best = node;
      if (j + 1 < kH) cur[j + 1] = node;
    }
    for (int j = 1; j <= top && j < kH; ++j) q.tail[j] = cur[j];
    if (e + 1 >= uint32_t(kLong)) {
      const uint32_t* g = q.toks.data() + (e + 1 - kLong);
      uint32_t l = grams_.find(g);
      if (l == kNil) {
        l = new_list();
        grams_.insert(g, l);
      }
      lists_[l].push_back(Ref{s, e});
    }
  }

  void compact() {
    auto dead = [this](Ref r) { return !seqs[r.seq].alive; };
    grams_.rebuild([&](uint32_t l) {
      auto& v = lists_[l];
      v.erase(std::remove_if(v.begin(), v.end(), dead), v.end());
      if (!v.empty()) return true;
      free_list(l);
      return false;
    });
    for (const Node& n : nodes)
      if (n.list != kNil) {
        auto& v = lists_[n.list];
        v.erase(std::remove_if(v.begin(), v.end(), dead), v.end());
      }
    dead_ = 0;
    free_seqs_.insert(free_seqs_.end(), pending_.begin(), pending_.end());
    pending_.clear();
  }
};

struct Limits {
  std::vector<int64_t> need, caps;  // per match length 0..D
};

// token -> count within one step of path(); a stamp per slot saves clearing it
class Counter {
 public:
  void resize(size_t n) {
    size_t cap = 64;
    while (cap < 2 * n) cap *= 2;
    keys_.assign(cap, 0);
    counts_.assign(cap, 0);
    stamps_.assign(cap, 0);
    mask_ = cap - 1;
  }
  void reset() {
    if (++stamp_ == 0) {
      std::fill(stamps_.begin(), stamps_.end(), 0u);
      stamp_ = 1;
    }
  }
  uint32_t add(uint32_t t) {
    size_t i = (uint32_t(t * 2654435761u) ^ (t >> 16)) & mask_;
    while (stamps_[i] == stamp_ && keys_[i] != t) i = (i + 1) & mask_;
    if (stamps_[i] != stamp_) {
      stamps_[i] = stamp_;
      keys_[i] = t;
      counts_[i] = 0;
    }
    return ++counts_[i];
  }

 private:
  std::vector<uint32_t> keys_, counts_, stamps_;
  size_t mask_ = 0;
  uint32_t stamp_ = 0;
};

struct Scored { int64_t L; Ref r; };
struct Cand { const uint32_t* seq; int64_t n, e; };

struct Draft {
  std::vector<uint32_t> toks;
  std::vector<double> probs;
  double score = 0.0;
};

struct Request {
  Tree tree;
  uint32_t cached = kNil;  // its response's slot in the global tree
};

struct Proposer {
  int64_t D, work_max, window[2];
  double f, off, pmin;
  bool neumaier;
  Tree global;
  std::vector<std::unique_ptr<Request>> reqs;
  std::vector<uint32_t> free_reqs;
  std::unordered_map<int64_t, Limits> limits;
  // scratch of one propose call
  std::vector<Scored> scored;
  std::vector<Ref> key, last_key;
  std::vector<int64_t> hist;
  std::vector<Cand> cur;
  std::vector<uint32_t> toks, tmp_t;
  std::vector<double> probs, tmp_p;
  Counter counter;
  Draft local, glob;
};

// Python's sum() over floats: left to right, or (CPython >= 3.12) Neumaier-compensated
double sum_probs(const double* p, int64_t n, bool neumaier) {
  if (!neumaier) {
    double s = 0.0;
    for (int64_t i = 0; i < n; ++i) s += p[i];
    return s;
  }
  if (n == 0) return 0.0;
  double s = p[0], c = 0.0;
  for (int64_t i = 1; i < n; ++i) {
    const double x = p[i], t = s + x;
    if (std::fabs(s) >= std::fabs(x)) c += (s - t) + x;
    else c += (x - t) + s;
    s = t;
  }
  if (c != 0.0 && std::isfinite(c)) s += c;
  return s;
}

// need[m] = max(0, min(K, int(m * f + off + 1e-6))); caps[m] = min(need[m], D - m)
const Limits& limits_for(Proposer& P, int64_t K) {
  auto it = P.limits.find(K);
  if (it != P.limits.end()) return it->second;
  Limits& lim = P.limits[K];
  lim.need.resize(P.D + 1);
  lim.caps.resize(P.D + 1);
  for (int64_t m = 0; m <= P.D; ++m) {
    volatile double x = double(m) * P.f;  // rounded after each step, as Python does
    x = x + P.off;
    x = x + 1e-6;
    const double v = x;
    lim.need[m] = v >= double(K) ? K : (v >= 1.0 ? int64_t(v) : 0);
    lim.caps[m] = std::min(lim.need[m], P.D - m);
  }
  return lim;
}

int64_t span(const Limits& lim, int64_t lo, int64_t hi) {
  int64_t run = 0;
  for (int64_t m = lo; m <= hi; ++m) run = run > lim.caps[m] ? run : lim.caps[m];
  return run;
}

// Python's _path: the greedy most-frequent continuation after the occurrences `key`
void path(Proposer& P, const Tree& tree, int64_t need, int64_t denom) {
  P.toks.clear();
  P.probs.clear();
  P.cur.clear();
  for (Ref r : P.key) {
    const Seq& q = tree.seqs[r.seq];
    P.cur.push_back(Cand{q.toks.data(), int64_t(q.toks.size()), int64_t(r.e)});
  }
  for (int64_t j = 1; j <= need; ++j) {
    if (P.cur.size() == 1) {  // one continuation left: copy it at constant probability
      const double p = 1.0 / double(denom);
      if (p < P.pmin) break;
      const Cand& c = P.cur[0];
      const int64_t end = std::min(c.e + need + 1, c.n);
      for (int64_t q = c.e + j; q < end; ++q) {
        P.toks.push_back(c.seq[q]);
        P.probs.push_back(p);
      }
      break;
    }
    P.counter.reset();
    uint32_t t = 0, c = 0;
    for (const Cand& x : P.cur) {  // oldest first: ties go to the first to reach the count
      const int64_t q = x.e + j;
      if (q < x.n) {
        const uint32_t n = P.counter.add(x.seq[q]);
        if (n > c) {
          t = x.seq[q];
          c = n;
        }
      }
    }
    if (!c) break;
    const double p = double(c) / double(denom);
    if (p < P.pmin) break;
    P.toks.push_back(t);
    P.probs.push_back(p);
    size_t w = 0;
    for (const Cand& x : P.cur)
      if (x.e + j < x.n && x.seq[x.e + j] == t) P.cur[w++] = x;
    P.cur.resize(w);
  }
}

// Python's _past_table: the path after a short match's table draft `s` (kH tokens), over the
// occurrences of s (its last kH - 1 tokens' list, windowed, preceded by s[0]); false if none
bool past_table(Proposer& P, const Tree& tree, const uint32_t* s, int64_t need, int64_t denom) {
  const std::vector<Ref>* lst = tree.trigram(s + 1);
  if (!lst) return false;
  P.key.clear();
  const size_t n = lst->size(), w = size_t(P.window[1]);
  for (size_t x = n > w ? n - w : 0; x < n; ++x) {
    const Ref r = (*lst)[x];
    const Seq& q = tree.seqs[r.seq];
    if (q.alive && r.e >= kH - 1 && q.toks[r.e - (kH - 1)] == s[0]) P.key.push_back(r);
  }
  if (P.key.empty()) return false;
  path(P, tree, need, denom);
  return true;
}

void take(Draft& out, const uint32_t* t, const double* p, int64_t n, double score) {
  out.toks.assign(t, t + n);
  out.probs.assign(p, p + n);
  out.score = score;
}

// The occurrences of one index level (Python's `scored`, in list order), or false if none.
bool score_level(Proposer& P, const Tree& tree, const std::vector<uint32_t>& ctx, int level,
                 int64_t upper, int64_t lo, uint32_t own) {
  const int64_t T = ctx.size(), k = level == 0 ? kLong : kH - 1;
  const std::vector<Ref>* lst = level == 0 ? tree.gram8(ctx.data() + T - kLong)
                                           : tree.trigram(ctx.data() + T - 3);
  P.scored.clear();
  if (!lst) return false;
  const size_t n = lst->size(), w = size_t(P.window[level]);
  for (size_t x = n > w ? n - w : 0; x < n; ++x) {
    const Ref r = (*lst)[x];
    const Seq& q = tree.seqs[r.seq];
    if (!q.alive) continue;  // evicted, not yet compacted
    if (r.seq == own && r.e + 1 == q.toks.size()) continue;  // the context's own tail
    const int64_t e = r.e;
    const uint32_t* s = q.toks.data();
    int64_t L = k;
    while (L < upper && L <= e && s[e - L] == ctx[T - 1 - L]) ++L;
    if (L >= lo) P.scored.push_back(Scored{L, r});
  }
  return !P.scored.empty();
}

// Python's _draft: the best (tokens, probs, score) of one tree above `floor`
void draft(Proposer& P, const Tree& tree, const std::vector<uint32_t>& ctx, const Limits& lim,
           double floor, uint32_t own, Draft& out) {
  out.toks.clear();
  out.probs.clear();
  out.score = floor;
  double& best = out.score;
  const int64_t T = ctx.size(), D = P.D;
  int64_t upper = std::min(T, D) - 1;
  if (upper < 1) return;
  const int64_t* need = lim.need.data();
  int64_t m_lo = 1;
  while (m_lo <= upper && need[m_lo] <= best) ++m_lo;
  bool have_last = false;
  int64_t last_len = 0, work = 0;
  P.toks.clear();
  P.probs.clear();
  for (int level = 0; level < 2; ++level) {
    const int64_t k = level == 0 ? kLong : kH - 1;
    if (k > upper) continue;
    if (upper < m_lo || work > P.work_max) break;
    const int64_t lo = std::max(k, m_lo);
    if (!score_level(P, tree, ctx, level, upper, lo, own)) {
      upper = k - 1;
      continue;
    }
    P.hist.assign(upper + 1, 0);
    for (const Scored& x : P.scored) ++P.hist[x.L];
    const int64_t n_all = P.scored.size();
    int64_t i = 0, top = upper;
    while (i < n_all) {  // match lengths longest first; scored[:i] have L >= top
      while (P.hist[top] == 0) --top;
      i += P.hist[top];
      int64_t bottom = lo;
      if (i < n_all) {
        int64_t nx = top - 1;
        while (P.hist[nx] == 0) --nx;
        bottom = nx + 1;
      }
      if (need[top] <= best || work > P.work_max) break;
      const int64_t length = std::min(need[top], D - bottom);
      P.key.clear();
      for (const Scored& x : P.scored)
        if (x.L >= top) P.key.push_back(x.r);
      if (!have_last || P.key != P.last_key ||
          (length > last_len && int64_t(P.toks.size()) == last_len)) {
        path(P, tree, length, i);
        work += i * length;
        P.last_key = P.key;
        have_last = true;
        last_len = length;
      }
      const int64_t c = std::min<int64_t>(span(lim, bottom, top), P.toks.size());
      if (c) {
        const double score = sum_probs(P.probs.data(), c, P.neumaier);
        if (score > best) {
          take(out, P.toks.data(), P.probs.data(), c, score);
          while (m_lo <= upper && need[m_lo] <= best) ++m_lo;
        }
      }
      --top;
    }
    upper = k - 1;
  }
  // matches of 1 .. kH - 2 tokens: read the exact count table, no scan
  for (int64_t m = std::min<int64_t>(upper, kH - 2); m >= 1; --m) {
    if (need[m] <= best) break;
    uint32_t node = 0;
    for (int64_t x = T - m; x < T && node != kNil; ++x) node = tree.child(node, ctx[x]);
    int64_t total = node != kNil ? tree.nodes[node].count : 0;
    if (total && own != kNil && int64_t(tree.seqs[own].toks.size()) >= m) --total;
    if (!total) continue;
    P.tmp_t.clear();
    P.tmp_p.clear();
    const int64_t steps = std::min(std::min(need[m], D - m), int64_t(kH) - m);
    for (int64_t s = 0; s < steps; ++s) {
      const uint32_t b = tree.nodes[node].best;
      if (b == kNil) break;
      node = b;
      const double p = double(tree.nodes[node].count) / double(total);
      if (p < P.pmin) break;
      P.tmp_t.push_back(tree.nodes[node].tok);
      P.tmp_p.push_back(p);
    }
    const int64_t all = std::min(need[m], D - m);
    if (int64_t(P.tmp_t.size()) == kH - m && kH - m < all) {  // Python's _past_table
      uint32_t s[kH];
      for (int64_t x = 0; x < m; ++x) s[x] = ctx[T - m + x];
      for (int64_t x = m; x < kH; ++x) s[x] = P.tmp_t[x - m];
      if (past_table(P, tree, s, all - (kH - m), total)) {
        P.tmp_t.insert(P.tmp_t.end(), P.toks.begin(), P.toks.end());
        P.tmp_p.insert(P.tmp_p.end(), P.probs.begin(), P.probs.end());
      }
    }
    const double score = sum_probs(P.tmp_p.data(), P.tmp_p.size(), P.neumaier);
    if (score > best) take(out, P.tmp_t.data(), P.tmp_p.data(), P.tmp_t.size(), score);
  }
}

const Draft* propose_one(Proposer& P, uint32_t r, int64_t k) {
  if (k <= 0) return nullptr;
  Request& R = *P.reqs[r];
  const std::vector<uint32_t>& ctx = R.tree.seqs[0].toks;
  const Limits& lim = limits_for(P, std::min(k, P.D));  // K > D drafts the same as K = D
  draft(P, R.tree, ctx, lim, 0.0, 0, P.local);
  if (P.global.n_alive > 0) {  // the global tree must score strictly higher to win
    draft(P, P.global, ctx, lim, P.local.score, R.cached, P.glob);
    if (P.glob.score > P.local.score) return &P.glob;
  }
  return &P.local;
}
}  // namespace

extern "C" {
void* npuspec_suffix_new(int64_t depth, double factor, double offset, double min_prob,
                         int64_t work, int64_t window_long, int64_t window_short,
                         int64_t compact_min, int64_t neumaier) {
  auto* P = new Proposer();
  P->D = depth;
  P->f = factor;
  P->off = offset;
  P->pmin = min_prob;
  P->work_max = work;
  P->window[0] = window_long;
  P->window[1] = window_short;
  P->neumaier = neumaier != 0;
  P->global.compact_min = compact_min;
  P->counter.resize(std::max(window_long, window_short));
  return P;
}

void npuspec_suffix_free(void* h) { delete static_cast<Proposer*>(h); }

double npuspec_suffix_sum(const double* p, int64_t n, int64_t neumaier) {  // for the tests
  return sum_probs(p, n, neumaier != 0);
}

int64_t npuspec_suffix_start(void* h, const uint32_t* toks, int64_t n) {
  auto& P = *static_cast<Proposer*>(h);
  uint32_t r;
  if (!P.free_reqs.empty()) {
    r = P.free_reqs.back();
    P.free_reqs.pop_back();
  } else {
    r = P.reqs.size();
    P.reqs.emplace_back();
  }
  P.reqs[r].reset(new Request());
  Tree& t = P.reqs[r]->tree;
  t.reserve(n);
  t.append(t.add_seq(kNil), toks, n);
  return r;
}

int64_t npuspec_suffix_add_response(void* h, int64_t r) {  // an empty cached response of r
  auto& P = *static_cast<Proposer*>(h);
  const uint32_t s = P.global.add_seq(r);
  P.reqs[r]->cached = s;
  return s;
}

void npuspec_suffix_remove_response(void* h, int64_t s) {
  auto& P = *static_cast<Proposer*>(h);
  const uint32_t owner = P.global.seqs[s].owner;
  if (owner != kNil) P.reqs[owner]->cached = kNil;  // it keeps running, uncached
  P.global.remove_seq(s);
}

void npuspec_suffix_extend(void* h, int64_t r, const uint32_t* toks, int64_t n) {
  auto& P = *static_cast<Proposer*>(h);
  Request& R = *P.reqs[r];
  R.tree.append(0, toks, n);
  if (R.cached != kNil) P.global.append(R.cached, toks, n);
}

// npuspec_suffix_extend for n requests in order: request rs[i] gets toks[offs[i]:offs[i+1]]
void npuspec_suffix_extend_many(void* h, const int64_t* rs, int64_t n, const uint32_t* toks,
                                const int64_t* offs) {
  for (int64_t i = 0; i < n; ++i)
    npuspec_suffix_extend(h, rs[i], toks + offs[i], offs[i + 1] - offs[i]);
}

void npuspec_suffix_stop(void* h, int64_t r) {
  auto& P = *static_cast<Proposer*>(h);
  if (P.reqs[r]->cached != kNil) P.global.seqs[P.reqs[r]->cached].owner = kNil;
  P.reqs[r].reset();
  P.free_reqs.push_back(r);
}

// Drafts of n requests (ks == nullptr: k0 for all), packed: request i's tokens are
// toks[offs[i] .. offs[i + 1]); probs may be null. Returns the total token count.
int64_t npuspec_suffix_propose(void* h, const int64_t* reqs, const int64_t* ks, int64_t k0,
                               int64_t n, uint32_t* toks, double* probs, int64_t* offs) {
  auto& P = *static_cast<Proposer*>(h);
  int64_t pos = 0;
  for (int64_t i = 0; i < n; ++i) {
    offs[i] = pos;
    const Draft* d = propose_one(P, reqs[i], ks ? ks[i] : k0);
    if (!d) continue;
    const int64_t m = d->toks.size();
    std::memcpy(toks + pos, d->toks.data(), m * sizeof(uint32_t));
    if (probs) std::memcpy(probs + pos, d->probs.data(), m * sizeof(double));
    pos += m;
  }
  offs[n] = pos;
  return pos;
}
}  // extern "C"
"""
