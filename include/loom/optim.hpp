#pragma once
// Umbrella header of loom::optim: AdamW, learning-rate schedules, clipping, accumulation.
#include <loom/optim/adamw.hpp>
#include <loom/optim/clip.hpp>
#include <loom/optim/grad_accumulation.hpp>
#include <loom/optim/lr_schedule.hpp>
