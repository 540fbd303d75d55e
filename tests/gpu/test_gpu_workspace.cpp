// The GPU workspace's size as one function: gpu::Workspace::device_bytes runs the allocation code
// itself, only counting. The plan's own estimate (gpu_scratch_bytes) must cover it (no device needed);
// and on a GPU, what a state's workspace takes from the accountant is exactly that figure.
#include <gtest/gtest.h>

#include "cuda/workspace.h"
#include "gpu_test_util.h"
#include "runtime/plan.h"

namespace fitmoe::gpu {
namespace {

// The synthetic 30B-A3B shape's hyperparameters (qwen3moe), with a few layers.
ModelConfig moe_shape() {
  ModelConfig c;
  c.arch = "qwen3moe";
  c.n_vocab = 151936;
  c.n_embd = 2048;
  c.n_layer = 4;
  c.n_head = 32;
  c.n_head_kv = 4;
  c.head_dim = c.head_dim_v = 128;
  c.n_rot = 128;
  c.n_expert = 128;
  c.n_expert_used = 8;
  c.n_ff_exp = 768;
  return c;
}

ModelConfig dense_shape() {
  ModelConfig c = moe_shape();
  c.arch = "qwen3";
  c.n_expert = c.n_expert_used = c.n_ff_exp = 0;
  c.n_ff = 6144;
  return c;
}

TEST(CudaWorkspace, PlanEstimateCoversTheWorkspace) {
  const uint64_t expert_bytes = 3ull * 768 * 2048 * 9 / 16;  // about Q4_K
  for (const ModelConfig& c : {moe_shape(), dense_shape()})
    for (int ub : {1, 8, 512, 2048})
      for (int ctx : {256, 4096, 40960})
        for (bool flash : {false, true}) {
          WorkspaceShape s;
          s.ubatch = ub;
          s.n_ctx = ctx;
          s.expert_bytes = c.n_expert ? expert_bytes : 0;
          s.host_experts = c.n_expert > 0;  // (the ring: what the plan counts for every MoE model)
          s.flash_kv = flash;
          const uint64_t got = Workspace::device_bytes(c, s, 16);
          const uint64_t plan = gpu_scratch_bytes(c, ub, ctx, s.expert_bytes, 16, flash);
          EXPECT_LE(got, plan) << c.arch << " ubatch " << ub << " n_ctx " << ctx << (flash ? " flash" : "");
          EXPECT_GT(got, 0u);
        }
}

TEST(GpuWorkspace, TakesWhatItCounts) {
  if (!test::has_device()) GTEST_SKIP() << "no CUDA GPU";
  for (const ModelConfig& c : {moe_shape(), dense_shape()})
    for (int ub : {1, 512})
      for (DType kt : {DType::F16, DType::TQ3}) {
        Plan plan;
        plan.budget = 8ull << 30;
        plan.options.n_ubatch = ub;
        plan.options.n_ctx = 1024;
        Engine e(c, plan);
        WorkspaceShape s;
        s.ubatch = ub;
        s.expert_bytes = c.n_expert ? 4096 : 0;
        s.host_experts = c.n_expert > 0;
        StateOptions so;
        so.n_ctx = 1024;
        so.kv = KvCacheType{kt, kt};
        const uint64_t before = e.mem.used();
        bool fresh = false;
        e.workspace(s, so, &fresh);
        EXPECT_TRUE(fresh);
        WorkspaceShape counted = s;
        counted.n_ctx = so.n_ctx;
        counted.flash_kv = so.kv.flash_on();
        EXPECT_EQ(e.mem.used() - before, Workspace::device_bytes(c, counted, e.chunk_experts))
            << c.arch << " ubatch " << ub << " " << dtype_name(kt);
        // Every further sequence takes its KV cache only; one that does not fit the workspace is refused.
        for (int i = 0; i < 2; ++i) {
          const uint64_t at = e.mem.used();
          e.workspace(s, so, &fresh);
          EXPECT_FALSE(fresh);
          GpuState st(e, so);
          EXPECT_EQ(e.mem.used() - at, st.kv.bytes());
          EXPECT_EQ(st.kv.bytes(), kv_cache_bytes(c, so.n_ctx, so.kv)) << c.arch << " " << dtype_name(kt);
        }
        StateOptions bigger = so;
        bigger.n_ctx = 2048;
        EXPECT_THROW(e.workspace(s, bigger, &fresh), Error);
      }
}

}  // namespace
}  // namespace fitmoe::gpu
