#pragma once
// loom core: errors, element types, device tags, memory resources, buffers, views, RNG.
#include <loom/core/buffer.hpp>
#include <loom/core/config.hpp>
#include <loom/core/device.hpp>
#include <loom/core/dtype.hpp>
#include <loom/core/error.hpp>
#include <loom/core/float16.hpp>
#include <loom/core/memory.hpp>
#include <loom/core/random.hpp>
#include <loom/core/tensor_view.hpp>
