#pragma once
// Umbrella header of loom::amp: loss scalers, overflow detection, fp32 master weights.
#include <loom/amp/loss_scaler.hpp>
#include <loom/amp/master_weights.hpp>
#include <loom/amp/overflow.hpp>
