#pragma once
// Forwarding header: the CPU shim stands in for the CUDA toolkit header.
#include "../cuda_shim.h"
