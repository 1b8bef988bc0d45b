// Weight-only 4- and 8-bit linear layers for few rows, multiplied in integers as llama.cpp does at
// batch 1: each input row is quantized once per call to int8 in blocks of 32 values (llama.cpp's
// Q8_1: d = max|x| / 127, q = x * (1 / d) rounded to nearest, ties to even as its AVX2 row quantizer
// rounds, and s = d * sum(q)), the weights' codes multiply those int8 values in 16/32-bit integers,
// and the fp32 scales apply once per block of 32:
//   y[n] = sum_b  scale[n, g(b)] * d[b] * sum_k code[n, k] q[k]  +  offset[n, g(b)] * s[b]
// which is the dequantized weight (code * scale + offset) times the dequantized row (q * d), exactly up
// to the order of the fp32 sums. The float kernel (wna16_linear.cpp) dequantizes every weight to fp32
// instead; at one row that, not memory, set its pace. The weight forms are wna16_linear.cpp's:
// w = u * scale + offset with unsigned codes u; 8-bit codes are kept signed here (c = u - 128, offset
// + 128 * scale), so that vpmaddubsw's unsigned-times-signed pairs never overflow 16 bits (|c| <= 128
// against the row's signed int8, llama.cpp's sign trick).
//
// Layout (pack_q8_dot_weight): panels of 8 output columns; within one, per block of 32 values of K,
// 4-bit codes as 4 chunks of 32 bytes (chunk j: byte 4c + t holds column c's value 8j + t in its low
// nibble and 8j + 4 + t in its high one), 8-bit codes as 8 chunks (chunk j: byte 4c + t holds column
// c's value 4j + t); the scales and offsets as [panels, K / group, 8], fp16 where every value is exactly
// so (a GGUF's, whose blocks hold fp16: a 4-bit weight then reads as many bytes as Q4_1), else fp32, and
// the offsets left out (an empty tensor) where all are zero (symmetric 8-bit). Columns past N are zero.
// One broadcast of four row values then multiplies all 8 columns (vpmaddubsw), so the per-column sums
// come out in one vector, with no horizontal add per block. The group must be a multiple of 32.
// The form is chosen when called by the CPU's flags: AVX-512 VNNI, AVX2, else a scalar loop (the same
// arithmetic; every form's integer sums per block are the same, so their outputs are too).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <immintrin.h>

// Named, not anonymous: ops/cpu_kernels.py builds every source as one translation unit.
namespace q8_dot {

constexpr int64_t kBlock = 32;    // values per activation block (llama.cpp's QK8_1)
constexpr int64_t kColumns = 8;   // one panel: one AVX2 vector of int32 sums
constexpr int kMaxRows = 4;       // rows per pass over a panel
// How far ahead of the block in hand its panel is prefetched: at one row the weights stream from
// memory once, and a software prefetch of every line 1 KiB ahead read them 20% faster than the
// hardware prefetcher alone (Zen 2, one and two threads; 512 B and 2 KiB did less; docs/benchmarks.md).
constexpr int64_t kPrefetchBytes = 1024;

// A row quantized in blocks of 32: codes [K], scales d [K / 32], scaled code sums s [K / 32]; for the
// VNNI form's 8-bit weights also its integer code sums [K / 32].
struct Q8Row {
  const int8_t* codes;
  const float* d;
  const float* s;
  const int32_t* code_sums = nullptr;
};

// Scales and offsets are fp32, or fp16 where they are exactly so (a GGUF's: 20% fewer bytes a 4-bit
// weight); offsets may be absent (symmetric 8-bit codes: zero).
struct Panels {
  const uint8_t* codes;
  const void* scales;
  const void* offsets;  // null: no offset term
  bool half;
  int64_t k, group, bits;
  int64_t panel_bytes() const { return k * kColumns * bits / 8; }
  int64_t groups() const { return k / group; }
  float scale_at(int64_t at) const { return value_at(scales, at); }
  float offset_at(int64_t at) const { return offsets ? value_at(offsets, at) : 0.0f; }
  float value_at(const void* values, int64_t at) const {
    return half ? static_cast<float>(static_cast<const c10::Half*>(values)[at]) : static_cast<const float*>(values)[at];
  }
};

// --- the row quantizer ---

void quantize_block_scalar(const float* x, int8_t* q, float* d_out, float* s_out) {
  float abs_max = 0.0f;
  for (int64_t i = 0; i < kBlock; ++i) abs_max = std::fmax(abs_max, std::fabs(x[i]));
  const float d = abs_max / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  int sum = 0;
  for (int64_t i = 0; i < kBlock; ++i) {
    q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inverse));  // default mode: ties to even
    sum += q[i];
  }
  *d_out = d;
  *s_out = d * static_cast<float>(sum);
}

__attribute__((target("avx2,fma"))) void quantize_block_avx2(const float* x, int8_t* q, float* d_out, float* s_out) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  __m256 v[4];
  __m256 abs_max = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(x + 8 * i);
    abs_max = _mm256_max_ps(abs_max, _mm256_and_ps(v[i], magnitude));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(abs_max), _mm256_extractf128_ps(abs_max, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float d = _mm_cvtss_f32(m4) / 127.0f, inverse = d != 0.0f ? 1.0f / d : 0.0f;
  const __m256 inverse_v = _mm256_set1_ps(inverse);
  __m256i ints[4];
  for (int i = 0; i < 4; ++i) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse_v));  // ties to even
  const __m256i sum = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
  s4 = _mm_hadd_epi32(s4, s4);
  s4 = _mm_hadd_epi32(s4, s4);
  // packs interleave the 128-bit lanes; the permute puts the 32 values back in order
  const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]), _mm256_packs_epi32(ints[2], ints[3]));
  const __m256i ordered = _mm256_permutevar8x32_epi32(words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), ordered);
  *d_out = d;
  *s_out = d * static_cast<float>(_mm_cvtsi128_si32(s4));
}

bool has_avx2() {
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

bool has_avx512_vnni() {
  return has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
}

// Which panel kernels a call runs: by the CPU's flags unless asked.
enum class Form { kScalar = 0, kAvx2 = 1, kVnni = 2 };

// `requested`: -1 for the CPU's best, else a Form's number (tests and benchmarks compare the forms).
Form form_for(int64_t requested) {
  const Form best = has_avx512_vnni() ? Form::kVnni : has_avx2() ? Form::kAvx2 : Form::kScalar;
  if (requested < 0) return best;
  TORCH_CHECK(requested <= static_cast<int64_t>(best), "q8_dot: form ", requested, " is not one this CPU runs (up to ",
              static_cast<int64_t>(best), ")");
  return static_cast<Form>(requested);
}

void quantize_rows(const float* x, int64_t rows, int64_t k, int8_t* q, float* d, float* s, bool avx2) {
  const int64_t blocks = k / kBlock;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t at = r * k + b * kBlock, block = r * blocks + b;
      if (avx2)
        quantize_block_avx2(x + at, q + at, d + block, s + block);
      else
        quantize_block_scalar(x + at, q + at, d + block, s + block);
    }
}

// --- the panel kernels ---

// The code of column j at K index kk of one panel (the layout above).
inline int code_at(const uint8_t* panel, int64_t kk, int64_t j, int64_t bits) {
  const int64_t b = kk / kBlock, i = kk % kBlock;
  if (bits == 8) return static_cast<int8_t>(panel[b * 256 + (i / 4) * 32 + 4 * j + i % 4]);
  const int64_t chunk = i / 8, t = i % 8;
  const uint8_t byte = panel[b * 128 + chunk * 32 + 4 * j + t % 4];
  return t < 4 ? byte & 0xF : byte >> 4;
}

void panel_scalar(const Panels& w, int64_t p, const Q8Row* rows, int64_t count, float* out, int64_t ldo,
                  int64_t columns, const float* bias) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  const int64_t blocks = w.k / kBlock, per_group = w.group / kBlock;
  for (int64_t r = 0; r < count; ++r)
    for (int64_t j = 0; j < columns; ++j) {
      float sum = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        int dot = 0;
        for (int64_t i = 0; i < kBlock; ++i) dot += code_at(panel, b * kBlock + i, j, w.bits) * rows[r].codes[b * kBlock + i];
        const int64_t at = (p * w.groups() + b / per_group) * kColumns + j;
        sum = std::fma(static_cast<float>(dot), w.scale_at(at) * rows[r].d[b], sum);
        if (w.offsets) sum = std::fma(w.offset_at(at), rows[r].s[b], sum);
      }
      out[r * ldo + j] = sum + (bias ? bias[j] : 0.0f);
    }
}

// Four row values as one int32, broadcast to the 8 columns' lanes.
__attribute__((target("avx2"))) inline __m256i row_quad(const int8_t* codes) {
  int32_t quad;
  std::memcpy(&quad, codes, sizeof(quad));
  return _mm256_set1_epi32(quad);
}

// One block's integer sums for kRows rows: [row] -> 8 int32 lanes, one per column.
// 4-bit: 8 vpmaddubsw per row a block, summed in 16 bits (at most 16 * 15 * 127 = 30480 a lane), one
// vpmaddwd at the end; 8-bit: per chunk |c| times the row's values signed by c, widened at once (two
// products reach 2 * 128 * 127 = 32512).
template <int kRows, int kBits>
__attribute__((target("avx2,fma"))) inline void block_sums(const uint8_t* block, const Q8Row* rows, int64_t at,
                                                            __m256i* sums) {
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (kBits == 4) {
    const __m256i low_mask = _mm256_set1_epi8(0x0F);
    __m256i acc[kRows];
    for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
      const __m256i low = _mm256_and_si256(bytes, low_mask);
      const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_mask);
      for (int r = 0; r < kRows; ++r) {
        const int8_t* q = rows[r].codes + at + 8 * j;
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(low, row_quad(q)));
        acc[r] = _mm256_add_epi16(acc[r], _mm256_maddubs_epi16(high, row_quad(q + 4)));
      }
    }
    for (int r = 0; r < kRows; ++r) sums[r] = _mm256_madd_epi16(acc[r], ones);
  } else {
    for (int r = 0; r < kRows; ++r) sums[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m256i codes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 32 * j));
      const __m256i magnitude = _mm256_abs_epi8(codes);
      for (int r = 0; r < kRows; ++r) {
        const __m256i signed_row = _mm256_sign_epi8(row_quad(rows[r].codes + at + 4 * j), codes);
        sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(magnitude, signed_row), ones));
      }
    }
  }
}

// Eight scales or offsets of one group, as fp32.
template <bool kHalf>
__attribute__((target("avx2,fma,f16c"))) inline __m256 load_eight(const void* values, int64_t at) {
  if constexpr (kHalf)
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const c10::Half*>(values) + at)));
  else
    return _mm256_loadu_ps(static_cast<const float*>(values) + at);
}

// One block's integer sums [row] -> 8 columns, scaled into the rows' fp32 sums: the block's weight
// scales (group at `at`) times each row's d, and the offsets times its s.
template <int kRows, bool kHalf, bool kOffsets>
__attribute__((target("avx2,fma,f16c"))) inline void accumulate_block(const Panels& w, int64_t at, const Q8Row* rows,
                                                                      int64_t b, const __m256i* sums, __m256* acc) {
  const __m256 scale = load_eight<kHalf>(w.scales, at);
  for (int r = 0; r < kRows; ++r) {
    const __m256 block_scale = _mm256_mul_ps(scale, _mm256_set1_ps(rows[r].d[b]));
    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), block_scale, acc[r]);
  }
  if constexpr (kOffsets) {
    const __m256 offset = load_eight<kHalf>(w.offsets, at);
    for (int r = 0; r < kRows; ++r) acc[r] = _mm256_fmadd_ps(offset, _mm256_set1_ps(rows[r].s[b]), acc[r]);
  }
}

template <int kRows>
__attribute__((target("avx2"))) inline void store_rows(const __m256* acc, float* out, int64_t ldo, int64_t columns,
                                                       const float* bias) {
  for (int r = 0; r < kRows; ++r) {
    alignas(32) float values[kColumns];
    _mm256_store_ps(values, acc[r]);
    for (int64_t j = 0; j < columns; ++j) out[r * ldo + j] = values[j] + (bias ? bias[j] : 0.0f);
  }
}

template <int kRows, int kBits, bool kHalf, bool kOffsets>
__attribute__((target("avx2,fma,f16c"), flatten)) void panel_rows_avx2(const Panels& w, int64_t p, const Q8Row* rows,
                                                                   float* out, int64_t ldo, int64_t columns,
                                                                   const float* bias) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  const int64_t blocks = w.k / kBlock, per_group = w.group / kBlock, block_bytes = kBlock * kColumns * kBits / 8;
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i sums[kRows];
    const char* ahead = reinterpret_cast<const char*>(panel + b * block_bytes) + kPrefetchBytes;
    for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    block_sums<kRows, kBits>(panel + b * block_bytes, rows, b * kBlock, sums);
    accumulate_block<kRows, kHalf, kOffsets>(w, (p * w.groups() + b / per_group) * kColumns, rows, b, sums, acc);
  }
  store_rows<kRows>(acc, out, ldo, columns, bias);
}

// --- the AVX-512 VNNI form ---
// vpdpbusd multiplies four unsigned bytes by four signed ones into each int32 lane, so one product
// covers two chunks of a block (16 lanes: the 8 columns twice). The 4-bit codes are unsigned; the
// 8-bit ones are read with their sign bit flipped (c + 128), and 128 x the row block's code sum is
// taken off after, so that a block's integer sums are the AVX2 form's exactly. A row's operand for
// each product (two of its four-value groups, each to the eight lanes it meets) is permuted from its
// block's 32 values in a register: laid out in memory once a call instead, the rows' operands
// outgrew the L1 cache at K = 1728 and that form ran 30% slower than AVX2's there.

// Operand v of a block: which four-value groups of the row go to lanes 0-7 and to lanes 8-15.
// 4-bit: the low nibbles of chunks 0 and 1, their high nibbles, then the same of chunks 2 and 3;
// 8-bit: chunks 0 and 1, 2 and 3, 4 and 5, 6 and 7.
constexpr int kQuads[2][4][2] = {{{0, 2}, {1, 3}, {4, 6}, {5, 7}}, {{0, 1}, {2, 3}, {4, 5}, {6, 7}}};

// The integer code sum of each of a row's blocks (the 8-bit form's correction).
void block_code_sums(const int8_t* codes, int64_t blocks, int32_t* code_sums) {
  for (int64_t b = 0; b < blocks; ++b) {
    int32_t sum = 0;
    for (int64_t i = 0; i < kBlock; ++i) sum += codes[b * kBlock + i];
    code_sums[b] = sum;
  }
}

// One operand of a block times its rows (each row's block values in `groups`), into their lanes' sums.
template <int kRows>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) inline void multiply_rows(__m512i codes, __m512i operand,
                                                                                 const __m512i* groups, __m512i* wide) {
  for (int r = 0; r < kRows; ++r)
    wide[r] = _mm512_dpbusd_epi32(wide[r], codes, _mm512_permutexvar_epi32(operand, groups[r]));
}

template <int kRows, int kBits, bool kHalf, bool kOffsets>
__attribute__((target("avx512f,avx512bw,avx512vnni,avx2,fma,f16c"), flatten)) void panel_rows_vnni(
    const Panels& w, int64_t p, const Q8Row* rows, float* out, int64_t ldo, int64_t columns, const float* bias) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  const int64_t blocks = w.k / kBlock, per_group = w.group / kBlock, block_bytes = kBlock * kColumns * kBits / 8;
  const __m512i low_mask = _mm512_set1_epi8(0x0F), sign_bit = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i operand[4];  // the dword permutation that gives operand v from a block's eight groups
  for (int v = 0; v < 4; ++v) {
    alignas(64) int32_t index[16];
    for (int lane = 0; lane < 16; ++lane) index[lane] = kQuads[kBits == 8][v][lane / 8];
    operand[v] = _mm512_load_si512(index);
  }
  __m256 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    const char* ahead = reinterpret_cast<const char*>(block) + kPrefetchBytes;
    for (int64_t line = 0; line < block_bytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
    __m512i wide[kRows];
    for (int r = 0; r < kRows; ++r) wide[r] = _mm512_setzero_si512();
    __m512i groups[kRows];
    for (int r = 0; r < kRows; ++r)
      groups[r] = _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[r].codes + b * kBlock)));
    if constexpr (kBits == 8) {
      for (int v = 0; v < 4; ++v)
        multiply_rows<kRows>(_mm512_xor_si512(_mm512_loadu_si512(block + 64 * v), sign_bit), operand[v], groups, wide);
    } else {
      for (int pair = 0; pair < 2; ++pair) {
        const __m512i bytes = _mm512_loadu_si512(block + 64 * pair);
        multiply_rows<kRows>(_mm512_and_si512(bytes, low_mask), operand[2 * pair], groups, wide);
        multiply_rows<kRows>(_mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_mask), operand[2 * pair + 1], groups,
                             wide);
      }
    }
    __m256i sums[kRows];
    for (int r = 0; r < kRows; ++r) {
      sums[r] = _mm256_add_epi32(_mm512_castsi512_si256(wide[r]), _mm512_extracti64x4_epi64(wide[r], 1));
      if constexpr (kBits == 8) sums[r] = _mm256_sub_epi32(sums[r], _mm256_set1_epi32(128 * rows[r].code_sums[b]));
    }
    accumulate_block<kRows, kHalf, kOffsets>(w, (p * w.groups() + b / per_group) * kColumns, rows, b, sums, acc);
  }
  store_rows<kRows>(acc, out, ldo, columns, bias);
}

using PanelRows = void (*)(const Panels&, int64_t, const Q8Row*, float*, int64_t, int64_t, const float*);

template <int kBits, bool kHalf, bool kOffsets>
constexpr PanelRows kVnniByRows[] = {
    panel_rows_vnni<1, kBits, kHalf, kOffsets>, panel_rows_vnni<2, kBits, kHalf, kOffsets>,
    panel_rows_vnni<3, kBits, kHalf, kOffsets>, panel_rows_vnni<4, kBits, kHalf, kOffsets>};

template <int kBits, bool kHalf, bool kOffsets>
constexpr PanelRows kByRows[] = {panel_rows_avx2<1, kBits, kHalf, kOffsets>, panel_rows_avx2<2, kBits, kHalf, kOffsets>,
                                 panel_rows_avx2<3, kBits, kHalf, kOffsets>, panel_rows_avx2<4, kBits, kHalf, kOffsets>};

// The AVX2 or VNNI kernels for the weight's bits, scale type and offsets, by row count (1..kMaxRows).
template <int kBits>
const PanelRows* forms_for(const Panels& w, Form form) {
  if (form == Form::kVnni) {
    if (w.half) return w.offsets ? kVnniByRows<kBits, true, true> : kVnniByRows<kBits, true, false>;
    return w.offsets ? kVnniByRows<kBits, false, true> : kVnniByRows<kBits, false, false>;
  }
  if (w.half) return w.offsets ? kByRows<kBits, true, true> : kByRows<kBits, true, false>;
  return w.offsets ? kByRows<kBits, false, true> : kByRows<kBits, false, false>;
}

// One panel times every row, kMaxRows at a time.
void panel_all_rows(const Panels& w, int64_t p, const Q8Row* rows, int64_t count, float* out, int64_t ldo,
                    int64_t columns, const float* bias, Form form) {
  const PanelRows* forms =
      form == Form::kScalar ? nullptr : (w.bits == 4 ? forms_for<4>(w, form) : forms_for<8>(w, form));
  for (int64_t r = 0; r < count; r += kMaxRows) {
    const int64_t n = std::min<int64_t>(kMaxRows, count - r);
    if (forms)
      forms[n - 1](w, p, rows + r, out + r * ldo, ldo, columns, bias);
    else
      panel_scalar(w, p, rows + r, n, out + r * ldo, ldo, columns, bias);
  }
}

// --- dequantizing a panel (prefill's rows past the few-row limit multiply the dense weight) ---

// Panel p's columns as dense fp32 rows [columns, K] at `target`: fma(code, scale, offset) each.
void dequantize_panel_scalar(const Panels& w, int64_t p, float* target, int64_t columns) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  for (int64_t j = 0; j < columns; ++j)
    for (int64_t kk = 0; kk < w.k; ++kk) {
      const int64_t at = (p * w.groups() + kk / w.group) * kColumns + j;
      target[j * w.k + kk] = std::fma(static_cast<float>(code_at(panel, kk, j, w.bits)), w.scale_at(at), w.offset_at(at));
    }
}

// The same values eight at a time: a column's four bytes of a 4-bit chunk hold its values 8j..8j+7
// (low nibbles, then high), two 8-bit chunks' four bytes its values 4j..4j+7.
__attribute__((target("avx2,fma,f16c"))) void dequantize_panel_avx2(const Panels& w, int64_t p, float* target,
                                                                     int64_t columns) {
  const uint8_t* panel = w.codes + p * w.panel_bytes();
  const int64_t blocks = w.k / kBlock, per_group = w.group / kBlock, block_bytes = kBlock * kColumns * w.bits / 8;
  const __m128i low_mask = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * block_bytes;
    for (int64_t j = 0; j < columns; ++j) {
      const int64_t at = (p * w.groups() + b / per_group) * kColumns + j;
      const __m256 scale = _mm256_set1_ps(w.scale_at(at)), offset = _mm256_set1_ps(w.offset_at(at));
      float* out = target + j * w.k + b * kBlock;
      for (int64_t eight = 0; eight < 4; ++eight) {
        __m256i codes;
        if (w.bits == 4) {
          int32_t quad;
          std::memcpy(&quad, block + eight * 32 + 4 * j, sizeof(quad));
          const __m128i bytes = _mm_cvtsi32_si128(quad);
          const __m128i nibbles = _mm_unpacklo_epi32(_mm_and_si128(bytes, low_mask),
                                                     _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask));
          codes = _mm256_cvtepu8_epi32(nibbles);
        } else {
          int32_t quads[2];
          std::memcpy(&quads[0], block + 2 * eight * 32 + 4 * j, sizeof(int32_t));
          std::memcpy(&quads[1], block + (2 * eight + 1) * 32 + 4 * j, sizeof(int32_t));
          codes = _mm256_cvtepi8_epi32(_mm_set_epi32(0, 0, quads[1], quads[0]));
        }
        _mm256_storeu_ps(out + 8 * eight, _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), scale, offset));
      }
    }
  }
}

void check_layout(const torch::Tensor& packed, const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets,
                  int64_t k, int64_t bits, int64_t out_features) {
  TORCH_CHECK(bits == 4 || bits == 8, "q8_dot: 4- or 8-bit codes, got ", bits);
  TORCH_CHECK(scales.dim() == 3 && k % scales.size(1) == 0 && (k / scales.size(1)) % kBlock == 0,
              "q8_dot: the group must divide K and be a multiple of ", kBlock);
  const int64_t panels = (out_features + kColumns - 1) / kColumns;
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() && packed.dim() == 2 &&
                  packed.size(0) == panels && packed.size(1) == k * kColumns * bits / 8,
              "q8_dot: the packed codes do not fit K, N and the bits");
  const bool typed = scales.scalar_type() == torch::kFloat32 || scales.scalar_type() == torch::kHalf;
  TORCH_CHECK(typed && scales.is_contiguous() && scales.size(0) == panels && scales.size(2) == kColumns,
              "q8_dot: scales must be fp32 or fp16 [panels, K / group, 8]");
  TORCH_CHECK(!offsets.has_value() || (offsets->scalar_type() == scales.scalar_type() && offsets->is_contiguous() &&
                                       offsets->sizes() == scales.sizes()),
              "q8_dot: offsets must be shaped and typed as the scales");
}

Panels panels_of(const torch::Tensor& packed, const torch::Tensor& scales, const c10::optional<torch::Tensor>& offsets,
                 int64_t k, int64_t bits) {
  return {packed.data_ptr<uint8_t>(), scales.data_ptr(), offsets.has_value() ? offsets->data_ptr() : nullptr,
          scales.scalar_type() == torch::kHalf, k, k / scales.size(1), bits};
}

}  // namespace q8_dot

std::vector<torch::Tensor> quantize_q8_blocks(torch::Tensor x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.size(1) % q8_dot::kBlock == 0,
              "q8_dot: fp32 rows [rows, K] with K a multiple of 32 expected");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  auto codes = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({rows, k / q8_dot::kBlock}, x.options()), s = torch::empty_like(d);
  q8_dot::quantize_rows(x.data_ptr<float>(), rows, k, codes.data_ptr<int8_t>(), d.data_ptr<float>(),
                        s.data_ptr<float>(), q8_dot::has_avx2());
  return {codes, d, s};
}

// The kernel's scales and offsets [panels, groups, 8] from [N, groups] fp32 ones: for 8-bit codes the
// signed form's offsets (offset + 128 * scale, one rounding); fp16 where every value is exactly so, and
// no offsets (an empty tensor) where all are zero.
std::vector<torch::Tensor> kernel_scales(const torch::Tensor& scales, const torch::Tensor& offsets, int64_t bits,
                                         int64_t panels) {
  const int64_t n = scales.size(0), groups = scales.size(1);
  auto shifted = bits == 8 ? torch::addcmul(offsets, scales, torch::full({}, 128.0f, scales.options())) : offsets;
  auto widened = [&](const torch::Tensor& t) {  // [N, G] -> [panels, G, 8], columns past N zero
    auto padded = torch::zeros({panels * q8_dot::kColumns, groups}, t.options());
    padded.narrow(0, 0, n).copy_(t);
    return padded.view({panels, q8_dot::kColumns, groups}).transpose(1, 2).contiguous();
  };
  auto packed_scales = widened(scales), packed_offsets = widened(shifted);
  auto exactly_half = [](const torch::Tensor& t) { return t.to(torch::kHalf).to(torch::kFloat32).equal(t); };
  if (exactly_half(packed_scales) && exactly_half(packed_offsets)) {
    packed_scales = packed_scales.to(torch::kHalf);
    packed_offsets = packed_offsets.to(torch::kHalf);
  }
  if (!packed_offsets.any().item<bool>()) packed_offsets = packed_offsets.new_empty({0});
  return {packed_scales, packed_offsets};
}

std::vector<torch::Tensor> pack_q8_dot_weight(torch::Tensor codes, torch::Tensor scales, torch::Tensor offsets,
                                              int64_t bits) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8, "q8_dot: uint8 codes [N, K] expected");
  const int64_t n = codes.size(0), k = codes.size(1);
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == n && scales.sizes() == offsets.sizes() && k % scales.size(1) == 0,
              "q8_dot: scales and offsets must be [N, K / group]");
  TORCH_CHECK(bits == 4 || bits == 8, "q8_dot: 4- or 8-bit codes, got ", bits);
  TORCH_CHECK((k / scales.size(1)) % q8_dot::kBlock == 0, "q8_dot: the group must be a multiple of ", q8_dot::kBlock);
  codes = codes.contiguous();
  const int64_t panels = (n + q8_dot::kColumns - 1) / q8_dot::kColumns, panel_bytes = k * q8_dot::kColumns * bits / 8;
  auto packed = torch::zeros({panels, panel_bytes}, codes.options());
  const uint8_t* source = codes.data_ptr<uint8_t>();
  uint8_t* target = packed.data_ptr<uint8_t>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      for (int64_t j = 0; j < std::min(q8_dot::kColumns, n - p * q8_dot::kColumns); ++j) {
        const int64_t row = p * q8_dot::kColumns + j;
        uint8_t* panel = target + p * panel_bytes;
        for (int64_t kk = 0; kk < k; ++kk) {
          const uint8_t code = source[row * k + kk];
          TORCH_CHECK(code < (1 << bits), "q8_dot: code ", int(code), " does not fit ", bits, " bits");
          const int64_t b = kk / q8_dot::kBlock, i = kk % q8_dot::kBlock;
          if (bits == 8) {  // signed: c = u - 128
            panel[b * 256 + (i / 4) * 32 + 4 * j + i % 4] = static_cast<uint8_t>(code ^ 0x80);
          } else {
            const int64_t chunk = i / 8, t = i % 8;
            panel[b * 128 + chunk * 32 + 4 * j + t % 4] |= t < 4 ? code : code << 4;
          }
        }
      }
  });
  auto packed_scales = kernel_scales(scales.to(torch::kFloat32).contiguous(), offsets.to(torch::kFloat32).contiguous(),
                                     bits, panels);
  return {packed, packed_scales[0], packed_scales[1]};
}

// Offsets as the ops take them: absent where the packing left none (an empty tensor).
c10::optional<torch::Tensor> offsets_if_any(const torch::Tensor& offsets) {
  return offsets.numel() ? c10::optional<torch::Tensor>(offsets) : c10::nullopt;
}

torch::Tensor q8_dot_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets,
                            c10::optional<torch::Tensor> bias, int64_t bits, int64_t out_features, int64_t form_number) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "q8_dot: fp32 x [rows, in] expected");
  x = x.contiguous();
  const int64_t rows = x.size(0), k = x.size(1);
  TORCH_CHECK(k % q8_dot::kBlock == 0, "q8_dot: K must be a multiple of ", q8_dot::kBlock);
  const auto offset_values = offsets_if_any(offsets);
  q8_dot::check_layout(packed, scales, offset_values, k, bits, out_features);
  const q8_dot::Form form = q8_dot::form_for(form_number);
  const int64_t blocks = k / q8_dot::kBlock;
  auto codes = torch::empty({rows, k}, x.options().dtype(torch::kInt8));
  auto d = torch::empty({rows, blocks}, x.options()), s = torch::empty_like(d);
  q8_dot::quantize_rows(x.data_ptr<float>(), rows, k, codes.data_ptr<int8_t>(), d.data_ptr<float>(), s.data_ptr<float>(),
                        form != q8_dot::Form::kScalar);
  const bool code_sums_needed = form == q8_dot::Form::kVnni && bits == 8;
  auto code_sums = torch::empty({code_sums_needed ? rows : 0, blocks}, x.options().dtype(torch::kInt32));
  std::vector<q8_dot::Q8Row> quantized(rows);
  for (int64_t r = 0; r < rows; ++r) {
    quantized[r] = {codes.data_ptr<int8_t>() + r * k, d.data_ptr<float>() + r * blocks, s.data_ptr<float>() + r * blocks};
    if (code_sums_needed) {
      quantized[r].code_sums = code_sums.data_ptr<int32_t>() + r * blocks;
      q8_dot::block_code_sums(quantized[r].codes, blocks, code_sums.data_ptr<int32_t>() + r * blocks);
    }
  }
  torch::Tensor bias_values;
  if (bias.has_value()) bias_values = bias->to(torch::kFloat32).contiguous();
  const float* bias_data = bias.has_value() ? bias_values.data_ptr<float>() : nullptr;
  auto out = torch::empty({rows, out_features}, x.options());
  float* ys = out.data_ptr<float>();
  const q8_dot::Panels w = q8_dot::panels_of(packed, scales, offset_values, k, bits);
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t column = p * q8_dot::kColumns, columns = std::min(q8_dot::kColumns, out_features - column);
      q8_dot::panel_all_rows(w, p, quantized.data(), rows, ys + column, out_features, columns,
                             bias_data ? bias_data + column : nullptr, form);
    }
  });
  return out;
}

torch::Tensor q8_dot_dequantize(torch::Tensor packed, torch::Tensor scales, torch::Tensor offsets, int64_t bits,
                                int64_t out_features) {
  const int64_t k = packed.size(1) * 8 / (q8_dot::kColumns * bits);
  const auto offset_values = offsets_if_any(offsets);
  q8_dot::check_layout(packed, scales, offset_values, k, bits, out_features);
  auto dense = torch::empty({out_features, k}, scales.options().dtype(torch::kFloat32));
  const q8_dot::Panels w = q8_dot::panels_of(packed, scales, offset_values, k, bits);
  float* target = dense.data_ptr<float>();
  const bool avx2 = q8_dot::has_avx2();
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t columns = std::min(q8_dot::kColumns, out_features - p * q8_dot::kColumns);
      if (avx2)
        q8_dot::dequantize_panel_avx2(w, p, target + p * q8_dot::kColumns * k, columns);
      else
        q8_dot::dequantize_panel_scalar(w, p, target + p * q8_dot::kColumns * k, columns);
    }
  });
  return dense;
}

// The op's schema, declared once: Python reaches it as torch.ops.infer_recipes_cpu (ops/cpu_kernels.py).
TORCH_LIBRARY_FRAGMENT(infer_recipes_cpu, m) {
  m.def("quantize_q8_blocks(Tensor x) -> Tensor[]");
  m.def("pack_q8_dot_weight(Tensor codes, Tensor scales, Tensor offsets, int bits) -> Tensor[]");
  m.def("q8_dot_linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, Tensor? bias, int bits, "
        "int out_features, int form=-1) -> Tensor");
  m.def("q8_dot_dequantize(Tensor packed, Tensor scales, Tensor offsets, int bits, int out_features) -> Tensor");
}
TORCH_LIBRARY_IMPL(infer_recipes_cpu, CPU, m) {
  m.impl("quantize_q8_blocks", &quantize_q8_blocks);
  m.impl("pack_q8_dot_weight", &pack_q8_dot_weight);
  m.impl("q8_dot_linear", &q8_dot_linear);
  m.impl("q8_dot_dequantize", &q8_dot_dequantize);
}
