// Stub of <MetalPerformanceShadersGraph/MetalPerformanceShadersGraph.h>: the classes that
// torch's ATen/mps/MPSStream.h names, as opaque declarations.
#pragma once

#include <MetalPerformanceShaders/MetalPerformanceShaders.h>

@class MPSGraph;
@class MPSGraphExecutionDescriptor;
@class MPSGraphCompilationDescriptor;
