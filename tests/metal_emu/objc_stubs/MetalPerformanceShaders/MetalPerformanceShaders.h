// Stub of <MetalPerformanceShaders/MetalPerformanceShaders.h>: only the class that torch's
// ATen/mps/MPSStream.h names (the command buffer of PyTorch's MPS stream).
#pragma once

#include <Metal/Metal.h>

@interface MPSCommandBuffer : NSObject <MTLCommandBuffer>
@end
