// Float dispatch shared by cadence's CPU kernels, whichever instruction set they are built for.
#pragma once

#include <ATen/Dispatch.h>

// Runs __VA_ARGS__ (a lambda) with scalar_t bound to the C++ type of a float32 or bfloat16 tensor.
#define CADENCE_DISPATCH_FLOAT(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
