// PEFT's adapter_config.json as llama-serve --lora and the trainer's --lora-init read it
// (loom/lora/peft.hpp, through examples/llama/train3d/peft_folder.hpp): the JSON text, then
// lora::config_from_adapter_json, which must refuse by name what the adapter layer cannot
// take and otherwise give a config validate() accepts, that writes back to the same config,
// and that check_adapter() either matches against a base or refuses naming the tensor.
#include "fuzz_input.hpp"

#include <loom/data/json_input.hpp>
#include <loom/lora/peft.hpp>

#include <map>
#include <string>

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  loom_fuzz::call([&] {
    const auto j = loom::data::parse_json_input(std::string_view(reinterpret_cast<const char*>(data), size), "adapter_config");
    const loom::lora::config c = loom::lora::config_from_adapter_json(j, "adapter_config.json");
    // What the reader promises its callers
    if (c.r < 1 || c.r > loom::lora::max_rank || !std::isfinite(c.lora_alpha) || !(c.lora_dropout >= 0.0 && c.lora_dropout < 1.0) ||
        c.target_modules.empty())
      __builtin_trap();
    try {  // an accepted config must hold from here on: a loom::error now is a finding
      c.validate();
      const loom::lora::config back = loom::lora::config_from_adapter_json(loom::lora::adapter_config_json(c), "round trip");
      if (back.r != c.r || back.lora_alpha != c.lora_alpha || back.lora_dropout != c.lora_dropout ||
          back.use_rslora != c.use_rslora || back.target_modules != c.target_modules)
        __builtin_trap();
    } catch (const loom::error&) {
      __builtin_trap();
    }
    // A one-layer base with every module of both families and no tensors: the check must refuse
    // (a missing factor or a module of the other family), never accept or fail otherwise.
    std::map<std::string, loom::lora::module_shape> shapes;
    for (const auto m : loom::lora::known_modules) shapes[std::string(m)] = {8, 8};
    for (const char* family : {"llama", "chatglm"}) {
      bool refused = false;
      try {
        loom::lora::check_adapter(c, {}, family, 1, shapes, "adapter");
      } catch (const loom::error&) {
        refused = true;
      }
      if (!refused) __builtin_trap();
    }
  });
  return 0;
}
