// The planner, without a GPU: placement order, the even spread of experts, manual rules on top, the
// budget-too-small error, and the size / override parsers.
#include <gtest/gtest.h>

#include <sys/mman.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "model/model.h"
#include "runtime/error.h"
#include "runtime/machine.h"
#include "runtime/plan.h"
#include "testdata.h"

using namespace fitmoe;

namespace {

std::string tiny() { return test::testdata("qwen3moe-tiny/qwen3moe-tiny-f32.gguf"); }

Plan plan_for(const PlanOptions& po, uint64_t card = 8ull << 30, const std::string& path = tiny(),
              double pcie_bw = 0) {
  MachineProfile m = reference_consumer_machine(card);
  if (pcie_bw > 0) m.pcie_bw = pcie_bw;
  LoadOptions lo;
  lo.plan = po;
  lo.plan_only = true;
  lo.use_mmap = true;
  lo.machine = &m;
  return Model::load(path, lo)->plan();
}

int experts_on_gpu(const Plan& p, int layer) {
  for (auto& t : p.tensors)
    if (t.is_experts && t.layer == layer && t.name.find("gate_exps") != std::string::npos)
      return static_cast<int>(std::count(t.expert_on_gpu.begin(), t.expert_on_gpu.end(), true));
  return -1;
}

}  // namespace

TEST(Plan, EverythingFitsOnABigCard) {
  PlanOptions po;
  Plan p = plan_for(po);
  ASSERT_TRUE(p.use_gpu);
  EXPECT_EQ(experts_on_gpu(p, 0), 4);
  EXPECT_EQ(experts_on_gpu(p, 1), 4);
  EXPECT_EQ(p.host_experts, 0u);
  EXPECT_FALSE(p.find("token_embd.weight")->on_gpu);  // rows are looked up on the host
  EXPECT_TRUE(p.find("output.weight")->on_gpu);
  EXPECT_TRUE(p.find("blk.0.ffn_gate_inp.weight")->on_gpu);
  EXPECT_LE(p.gpu_total(), p.budget);
  EXPECT_GT(p.predicted_tg, 0);
  EXPECT_NE(p.report().find("why:"), std::string::npos);
}

TEST(Plan, ExpertsSpreadEvenlyWhenTheBudgetIsTight) {
  PlanOptions po;
  po.n_ubatch = 512;  // a fixed micro-batch, so that the scratch is the same in both plans
  Plan full = plan_for(po);
  // Room for about half of the experts: each layer gets the same number.
  po.vram_budget = full.gpu_weights + full.gpu_kv + full.gpu_scratch + full.reserve + full.gpu_experts / 2;
  Plan p = plan_for(po);
  const int a = experts_on_gpu(p, 0), b = experts_on_gpu(p, 1);
  EXPECT_GT(a, 0);
  EXPECT_LT(a, 4);
  EXPECT_LE(std::abs(a - b), 1);
  EXPECT_GT(p.host_expert_bytes_per_token, 0);
  EXPECT_LE(p.gpu_total(), p.budget);
}

// The automatic micro-batch: 2048 when everything fits with it or experts stay on the host anyway;
// 512 when only the smaller scratch lets every expert stay on the GPU.
TEST(Plan, AutomaticMicroBatch) {
  PlanOptions po;
  Plan big_card = plan_for(po);
  EXPECT_EQ(big_card.options.n_ubatch, 2048);
  EXPECT_EQ(big_card.host_experts, 0u);

  PlanOptions fixed = po;
  fixed.n_ubatch = 512;
  Plan at512 = plan_for(fixed);
  ASSERT_GT(big_card.gpu_scratch, at512.gpu_scratch);
  // Everything fits with a 512-token scratch, but not with the 2048-token one.
  po.vram_budget = at512.gpu_weights + at512.gpu_kv + at512.gpu_scratch + at512.reserve + at512.gpu_experts + 4096;
  Plan edge = plan_for(po);
  EXPECT_EQ(edge.options.n_ubatch, 512);
  EXPECT_EQ(edge.host_experts, 0u);

  // Experts on the host whatever the micro-batch (here by --cpu-moe): 2048, each micro-batch streams
  // them once. (This tiny model's experts weigh less than the scratch difference, so a budget alone
  // cannot force the case.)
  PlanOptions host = PlanOptions{};
  host.cpu_moe = true;
  Plan streamed = plan_for(host);
  EXPECT_EQ(streamed.options.n_ubatch, 2048);
  EXPECT_GT(streamed.host_experts, 0u);

  PlanOptions cpu_only;
  cpu_only.use_gpu = false;
  EXPECT_EQ(plan_for(cpu_only).options.n_ubatch, 512);
}

TEST(Plan, ManualRulesWinOverTheAutomaticPlan) {
  PlanOptions po;
  po.n_cpu_moe = 1;
  Plan p = plan_for(po);
  EXPECT_EQ(experts_on_gpu(p, 0), 0);
  EXPECT_EQ(experts_on_gpu(p, 1), 4);
  po = PlanOptions();
  po.cpu_moe = true;
  p = plan_for(po);
  EXPECT_EQ(experts_on_gpu(p, 0), 0);
  EXPECT_EQ(experts_on_gpu(p, 1), 0);
  EXPECT_TRUE(p.find("blk.1.ffn_gate_inp.weight")->on_gpu);  // routers stay on the GPU
  po = PlanOptions();
  po.overrides = parse_overrides({"blk\\.1\\.ffn_(up|down|gate)_exps=cpu", "output\\.weight=cpu"});
  p = plan_for(po);
  EXPECT_EQ(experts_on_gpu(p, 1), 0);
  EXPECT_EQ(experts_on_gpu(p, 0), 4);
  EXPECT_FALSE(p.find("output.weight")->on_gpu);
}

TEST(Plan, BudgetTooSmallSaysHowMuchIsNeeded) {
  PlanOptions po;
  po.vram_budget = 300ull << 20;
  try {
    plan_for(po);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string w = e.what();
    EXPECT_NE(w.find("too small"), std::string::npos) << w;
    EXPECT_NE(w.find("needed"), std::string::npos) << w;
  }
}

TEST(Plan, NoGpuMeansCpuOnly) {
  PlanOptions po;
  po.use_gpu = false;
  Plan p = plan_for(po);
  EXPECT_FALSE(p.use_gpu);
  EXPECT_EQ(p.gpu_total(), 0u);
}

TEST(Plan, ParsesSizesAndOverrides) {
  EXPECT_EQ(parse_size("8G"), 8ull << 30);
  EXPECT_EQ(parse_size("7.5GiB"), static_cast<uint64_t>(7.5 * (1ull << 30)));
  EXPECT_EQ(parse_size("512M"), 512ull << 20);
  EXPECT_THROW(parse_size("lots"), Error);
  EXPECT_THROW(parse_size("8Q"), Error);
  EXPECT_THROW(parse_size("-1G"), Error);
  auto o = parse_overrides({"exps=CPU,attn=cuda0"});
  ASSERT_EQ(o.size(), 2u);
  EXPECT_FALSE(o[0].to_gpu);
  EXPECT_TRUE(o[1].to_gpu);
  EXPECT_THROW(parse_overrides({"exps"}), Error);
  EXPECT_THROW(parse_overrides({"exps=tpu"}), Error);
  EXPECT_THROW(parse_overrides({"(=cpu"}), Error);
}

// The cost model follows the engine: host experts cost decode time, and a larger micro-batch spreads
// the streaming of host experts over more tokens.
TEST(Plan, CostModelFollowsTheEngine) {
  PlanOptions all_gpu;
  all_gpu.n_ubatch = 512;
  PlanOptions host = all_gpu;
  host.cpu_moe = true;
  host.prefill_host_experts = "upload";
  const Plan a = plan_for(all_gpu), h512 = plan_for(host);
  host.n_ubatch = 2048;
  const Plan h2048 = plan_for(host);
  EXPECT_GT(a.predicted_tg, h512.predicted_tg);
  EXPECT_GT(h2048.predicted_pp, h512.predicted_pp);
  EXPECT_GE(a.predicted_pp, h512.predicted_pp);  // equal when the streaming hides behind the products
}

// Prefill of host experts: a micro-batch that uses nearly every expert streams them all ahead of the
// routing; a small one waits for the routing and is charged only for the experts it is expected to use
// (1 - (1 - k/E)^n of them); the threshold is an option.
TEST(Plan, SmallMicroBatchesUploadOnlyTheExpertsUsed) {
  PlanOptions o;
  o.prefill_host_experts = "upload";
  MachineProfile m;
  m.pcie_bw = 50e9;
  m.cpu_int8_flops = 1e12;
  const double per_expert = 3e6, all = 128 * per_expert / m.pcie_bw;
  const HostExpertsCost big = prefill_host_experts_cost(o, m, 512, 8, 128, 128, per_expert);
  EXPECT_FALSE(big.after_routing);
  EXPECT_GT(big.used_fraction, 0.999);
  EXPECT_DOUBLE_EQ(big.upload_s, all);
  const HostExpertsCost small = prefill_host_experts_cost(o, m, 16, 8, 128, 128, per_expert);
  EXPECT_TRUE(small.after_routing);
  EXPECT_NEAR(small.used_fraction, 1 - std::pow(1 - 8.0 / 128, 16), 1e-12);
  EXPECT_NEAR(small.upload_s, all * small.used_fraction, 1e-12);
  o.prefill_prefetch_min_used = 0.5;  // 16 tokens use ~64%: now streamed ahead, all of them
  EXPECT_FALSE(prefill_host_experts_cost(o, m, 16, 8, 128, 128, per_expert).after_routing);
}

// Hybrid decode's GPU share of the host experts: a token with h host slots gives the GPU
// floor(h * share + 1/4) of them, so a share that takes nothing at the expected h is dropped (0), one that
// takes some is kept and predicts faster decode than none; every expert on the GPU means no share.
TEST(Plan, GpuShareOfHostExperts) {
  EXPECT_DOUBLE_EQ(host_experts_share_taken(0.2, 8, 80, 128), 0.2);  // h = 5: one of five
  EXPECT_DOUBLE_EQ(host_experts_share_taken(0.1, 8, 40, 128), 0.0);  // h = 2.5: none
  EXPECT_DOUBLE_EQ(host_experts_share_taken(1.0, 8, 128, 128), 1.0);
  EXPECT_DOUBLE_EQ(host_experts_share_taken(0.0, 8, 128, 128), 0.0);
  const std::string q4 = test::testdata("qwen3moe-tiny/qwen3moe-tiny-q4_k_m.gguf");
  const uint64_t card = 8ull << 30;
  PlanOptions o;
  o.cpu_moe = true;  // the tiny model: 2 of 4 experts per token, all on the host (h = 2)
  o.host_experts_gpu_share = 0;
  const Plan none = plan_for(o, card, q4);
  EXPECT_EQ(none.host_experts_gpu_share, 0.0);
  o.host_experts_gpu_share = 0.5;
  const Plan half = plan_for(o, card, q4);
  EXPECT_EQ(half.host_experts_gpu_share, 0.5);
  // Over the consumer machine's PCIe 3.0 half of the bytes take longer than all of them from host RAM
  // (the model knows); with a fast bus (the H200 machine's 54 GB/s) the share pays.
  EXPECT_LT(half.predicted_tg, none.predicted_tg);
  EXPECT_GT(plan_for(o, card, q4, 54e9).predicted_tg, plan_for(PlanOptions{none.options}, card, q4, 54e9).predicted_tg);
  EXPECT_EQ(plan_for(o).host_experts_gpu_share, 0.0);  // f32 experts: the kernels do not take a share
  o.host_experts_gpu_share = 0.1;  // floor(2 * 0.1 + 1/4) = 0
  EXPECT_EQ(plan_for(o, card, q4).host_experts_gpu_share, 0.0);
  o.host_experts_gpu_share = -1;
  const double autos = plan_for(o, card, q4).host_experts_gpu_share;
  EXPECT_GE(autos, 0.0);
  EXPECT_LE(autos, 1.0);
  EXPECT_EQ(plan_for(PlanOptions{}).host_experts_gpu_share, 0.0);  // every expert on the GPU
}

// The huge-page count behind the load message, against the kernel's own count for the mapping: an
// aligned 8 MiB region asked for with MADV_HUGEPAGE gets a mapping of its own (madvise splits it off),
// whose AnonHugePages line in /proc/self/smaps is read here by exact address (whether the kernel gives
// huge pages at all varies; the two counts must agree either way). A region asked for with
// MADV_NOHUGEPAGE must count zero.
namespace {
int64_t anon_huge_of_exact_mapping(const void* p, size_t n) {
  std::ifstream in("/proc/self/smaps");
  char head[64];
  std::snprintf(head, sizeof head, "%lx-%lx ", static_cast<unsigned long>(reinterpret_cast<uintptr_t>(p)),
                static_cast<unsigned long>(reinterpret_cast<uintptr_t>(p) + n));
  bool in_it = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(head, 0) == 0) in_it = true;
    unsigned long long kb = 0;
    if (in_it && std::sscanf(line.c_str(), "AnonHugePages: %llu kB", &kb) == 1) return static_cast<int64_t>(kb * 1024);
  }
  return -1;
}
}  // namespace

TEST(Machine, HugePageBytesOfAMapping) {
  const size_t n = 8u << 20, huge2m = 2u << 20;
  void* raw = mmap(nullptr, 2 * n + huge2m, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(raw, MAP_FAILED);
  auto* p = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + huge2m - 1) & ~uintptr_t(huge2m - 1));
  uint8_t* q = p + n;  // the second region, without huge pages
  madvise(p, n, MADV_HUGEPAGE);
  madvise(q, n, MADV_NOHUGEPAGE);
  std::memset(p, 1, 2 * n);
  const int64_t huge = huge_page_bytes(p, n);
  ASSERT_GE(huge, 0) << "/proc/self/smaps is readable on Linux";
  EXPECT_LE(huge, static_cast<int64_t>(n));
  EXPECT_EQ(huge % huge2m, 0) << "AnonHugePages counts whole 2 MiB pages";
  const int64_t want = anon_huge_of_exact_mapping(p, n);
  ASSERT_GE(want, 0) << "madvise gave the region a mapping of its own";
  EXPECT_EQ(huge, want);
  EXPECT_EQ(huge_page_bytes(q, n), 0) << "MADV_NOHUGEPAGE";
  EXPECT_LE(huge_page_bytes(p, 4096), 4096) << "never more than the range asked about";
  EXPECT_FALSE(huge_page_policy().empty());
  munmap(raw, 2 * n + huge2m);
}

TEST(Plan, CpuRateIsInterpolatedBetweenMeasuredWidths) {
  MachineProfile m;
  m.cpu_int8_flops = 7e9;
  EXPECT_DOUBLE_EQ(cpu_matmul_rate(m, 8), 7e9);  // no measured widths: the one rate
  m.cpu_matmul_flops[0] = 1e9, m.cpu_matmul_flops[1] = 8e9, m.cpu_matmul_flops[2] = 64e9;
  EXPECT_NEAR(cpu_matmul_rate(m, 1), 1e9, 1e3);
  EXPECT_NEAR(cpu_matmul_rate(m, 8), 8e9, 1e4);
  EXPECT_NEAR(cpu_matmul_rate(m, 64), 64e9, 1e5);
  EXPECT_NEAR(cpu_matmul_rate(m, 4), 4e9, 1e4);     // log-linear: rate proportional to width here
  EXPECT_NEAR(cpu_matmul_rate(m, 512), 64e9, 1e5);  // flat beyond the widest measured
  EXPECT_NEAR(cpu_matmul_rate(m, 0.25), 1e9, 1e3);
}

TEST(Plan, CpuPredictionFollowsTheCpuKernelsRates) {
  // CPU only: generation scales with the one-token kernel's rate over RAM, prompt with the batch rates;
  // the output head is charged once per batch, not per prompt token.
  auto predict = [](double decode_bw, double flops) {
    MachineProfile m = reference_consumer_machine(0);
    m.cpu_decode_bw = decode_bw;
    m.host_mem_bw = 50e9;
    m.cpu_matmul_flops[0] = flops / 8, m.cpu_matmul_flops[1] = flops / 2, m.cpu_matmul_flops[2] = flops;
    LoadOptions lo;
    lo.plan.use_gpu = false;
    lo.plan_only = true;
    lo.use_mmap = true;
    lo.machine = &m;
    return Model::load(tiny(), lo)->plan();
  };
  const Plan a = predict(10e9, 100e9), b = predict(5e9, 100e9), c = predict(10e9, 50e9);
  EXPECT_GT(a.predicted_tg, 1.6 * b.predicted_tg);
  EXPECT_LT(a.predicted_tg, 2.0 * b.predicted_tg + 1e-9);
  EXPECT_NEAR(a.predicted_tg, c.predicted_tg, 1e-9);  // decode does not depend on the batch rate
  EXPECT_GT(a.predicted_pp, 1.6 * c.predicted_pp);
  // The tiny model's head (1024 x 256) is a third of its weights: charged per prompt token at the
  // one-token rate (flops / 8 here) it alone would bound the prompt below this; once per batch it does not.
  EXPECT_GT(a.predicted_pp, 100e9 / 8 / (2.0 * 1024 * 256));
}

TEST(Plan, RecurrentModelChargesKvOnlyForAttentionLayersAndItsFixedState) {
  // qwen35moe-tiny: blk.0 DeltaNet, blk.1 full attention (1 KV head of 64): KV for one layer only,
  // plus the DeltaNet's conv and delta state with its checkpoints, as the states allocate.
  PlanOptions po;
  po.use_gpu = false;
  po.n_ctx = 1000;
  const Plan p = plan_for(po, 8ull << 30, test::testdata("qwen35moe-tiny/qwen35moe-tiny-f32.gguf"));
  const uint64_t kv_per_pos = 1 * (64 + 64) * 2;  // f16 K and V rows of one layer
  EXPECT_GT(p.state_bytes, 0u);
  EXPECT_EQ(p.host_kv, kv_per_pos * 1000 + p.state_bytes);
  EXPECT_NE(p.report().find("recurrent state"), std::string::npos);
}

// -ctk / -ctv auto: f16 while its cache takes at most half of what is left beside the non-expert
// weights (or every expert fits anyway), else the first of q8_0, tq4, tq3, tq2 that does, else the
// smallest that fits; the plan names the choice and why. An explicit type is never replaced.
TEST(Plan, AutomaticKvCacheTypeFollowsTheRoomBesideTheWeights) {
  auto has_note = [](const Plan& p, const std::string& what) {
    for (const auto& n : p.notes)
      if (n.find(what) != std::string::npos) return true;
    return false;
  };
  PlanOptions po;
  po.n_ubatch = 512;
  po.n_ctx = 40000;
  po.kv.automatic = true;
  // A big card: f16 (every expert fits beside it).
  Plan big = plan_for(po);
  EXPECT_EQ(big.options.kv.k, DType::F16);
  EXPECT_FALSE(big.options.kv.automatic);
  EXPECT_TRUE(has_note(big, "KV cache type (automatic): f16")) << big.report();

  // A budget where the f16 cache would take most of the room beside the weights and leave the experts
  // on the host: a smaller type, named with its bytes and the reason.
  PlanOptions f16 = po;
  f16.kv = KvCacheType{};
  const Plan full = plan_for(f16);
  PlanOptions tight = po;
  tight.vram_budget = full.gpu_weights + full.gpu_scratch + full.reserve + full.gpu_kv * 6 / 5;
  const Plan t = plan_for(tight);
  EXPECT_NE(t.options.kv.k, DType::F16);
  EXPECT_TRUE(t.options.kv.flash_on());
  EXPECT_LE(t.gpu_kv, full.gpu_kv * 17 / 32 + 4096);  // (q8_0: 34 bytes per 32 values, or smaller)
  EXPECT_TRUE(has_note(t, "KV cache type (automatic): " + t.options.kv.name())) << t.report();
  EXPECT_TRUE(has_note(t, "f16 (flash) would take") || has_note(t, "f16 would take")) << t.report();
  EXPECT_NE(t.report().find(t.options.kv.name()), std::string::npos);

  // Explicit f16 at that budget: f16 it is (the experts go to the host), no automatic note.
  PlanOptions fixed = tight;
  fixed.kv = KvCacheType{};
  try {
    const Plan e = plan_for(fixed);
    EXPECT_EQ(e.options.kv.k, DType::F16);
    EXPECT_FALSE(has_note(e, "automatic"));
  } catch (const Error& err) {
    EXPECT_NE(std::string(err.what()).find("KV cache"), std::string::npos) << err.what();
  }

  // -fa off with auto: only f16 can be chosen; no GPU: f16 on the host.
  PlanOptions off = po;
  off.kv.flash = FlashAttn::Off;
  EXPECT_EQ(plan_for(off).options.kv.k, DType::F16);
  PlanOptions cpu = po;
  cpu.use_gpu = false;
  EXPECT_EQ(plan_for(cpu).options.kv.k, DType::F16);
}
