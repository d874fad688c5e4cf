#pragma once
// <cuda_runtime.h> for code compiled with g++ under the emulator: the runtime API
// (cuda_runtime_api.h here) and the device-side names (../emulation.hpp).
#include "cuda_runtime_api.h"
