// fitmoe plan: where every tensor of a model would live for a VRAM budget and context, the memory
// map, the predicted speed and why -- without reading any weight or taking GPU memory.
#include <cstdio>

#include "cli/common.h"
#include "runtime/machine.h"

namespace fitmoe::cli {

void register_plan(CLI::App& app) {
  auto* cmd = app.add_subcommand("plan", "show where each tensor would live for a VRAM budget, and the predicted speed");
  auto o = std::make_shared<ModelOptions>();
  auto host_bw = std::make_shared<double>(0), pcie_bw = std::make_shared<double>(0), gpu_bw = std::make_shared<double>(0),
       gpu_tflops = std::make_shared<double>(0);
  add_model_options(*cmd, *o);
  cmd->add_option("--host-bw", *host_bw, "host RAM read bandwidth in GB/s (default: measured)");
  cmd->add_option("--pcie-bw", *pcie_bw, "pinned host-to-device bandwidth in GB/s (default: measured)");
  cmd->add_option("--gpu-bw", *gpu_bw, "GPU memory bandwidth in GB/s (default: measured)");
  cmd->add_option("--gpu-tflops", *gpu_tflops, "f16 matrix rate prefill reaches, in TFLOP/s (default: from the device)");
  cmd->callback([o, host_bw, pcie_bw, gpu_bw, gpu_tflops] {
    LoadOptions lo = load_options(*o);
    lo.plan_only = true;
    lo.use_mmap = true;
    MachineProfile m = probe_machine(o->threads, lo.plan.use_gpu);
    if (lo.plan.use_gpu && m.gpu_free_bytes == 0 && lo.plan.vram_budget) {
      // No GPU here: plan for a typical consumer card of the given size.
      MachineProfile c = reference_consumer_machine(lo.plan.vram_budget);
      c.host_mem_bw = m.host_mem_bw > 0 ? m.host_mem_bw : c.host_mem_bw;
      c.cpu_int8_flops = m.cpu_int8_flops > 0 ? m.cpu_int8_flops : c.cpu_int8_flops;
      c.cpu_decode_bw = m.cpu_decode_bw;
      std::copy(m.cpu_matmul_flops, m.cpu_matmul_flops + 3, c.cpu_matmul_flops);
      c.cpu_threads = m.cpu_threads;
      m = c;
    }
    if (*host_bw > 0) m.host_mem_bw = *host_bw * 1e9, m.source += ", host bw from flags";
    if (*pcie_bw > 0) m.pcie_bw = *pcie_bw * 1e9, m.source += ", PCIe from flags";
    if (*gpu_bw > 0) m.gpu_mem_bw = *gpu_bw * 1e9, m.source += ", GPU bw from flags";
    if (*gpu_tflops > 0) m.gpu_flops = *gpu_tflops * 1e12, m.source += ", GPU rate from flags";
    lo.machine = &m;
    auto model = Model::load(o->model_path, lo);
    std::printf("model: %s (%s, %d layers, %d experts x %d active)\n", o->model_path.c_str(), model->config().arch.c_str(),
                model->config().n_layer, model->config().n_expert, model->config().n_expert_used);
    std::printf("%s", model->plan().report().c_str());
  });
}

}  // namespace fitmoe::cli
