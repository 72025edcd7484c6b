// Stub of <Metal/Metal.h> for the Metal host code on Linux (see Foundation.h). Declares exactly
// the API rlx and the torch MPS headers use, with the selectors, types and enum values of
// Apple's documentation (developer.apple.com/documentation/metal): MTLDevice, MTLLibrary,
// MTLFunction, MTLCompileOptions, MTLComputePipelineState, MTLBuffer, MTLCommandQueue,
// MTLCommandBuffer, MTLComputeCommandEncoder, MTLSharedEvent, MTLSize.
#pragma once

#include <Foundation/Foundation.h>

#define RLX_STUB_MACOS(version) __attribute__((availability(macos, introduced = version)))

typedef struct {
  NSUInteger width;
  NSUInteger height;
  NSUInteger depth;
} MTLSize;

static inline MTLSize MTLSizeMake(NSUInteger width, NSUInteger height, NSUInteger depth) {
  MTLSize s = {width, height, depth};
  return s;
}

// MTLLanguageVersion: (major << 16) + minor.
typedef enum : NSUInteger {
  MTLLanguageVersion2_4 RLX_STUB_MACOS(12.0) = (2 << 16) + 4,
  MTLLanguageVersion3_0 RLX_STUB_MACOS(13.0) = (3 << 16) + 0,
  MTLLanguageVersion3_1 RLX_STUB_MACOS(14.0) = (3 << 16) + 1,
  MTLLanguageVersion3_2 RLX_STUB_MACOS(15.0) = (3 << 16) + 2,
} MTLLanguageVersion;

typedef enum : NSInteger {
  MTLMathModeSafe = 0,
  MTLMathModeRelaxed = 1,
  MTLMathModeFast = 2,
} MTLMathMode RLX_STUB_MACOS(15.0);

typedef enum : NSInteger {
  MTLMathFloatingPointFunctionsFast = 0,
  MTLMathFloatingPointFunctionsPrecise = 1,
} MTLMathFloatingPointFunctions RLX_STUB_MACOS(15.0);

@protocol MTLFunction <NSObject>
@end

@protocol MTLLibrary <NSObject>
- (id<MTLFunction>)newFunctionWithName:(NSString*)functionName;
@end

@interface MTLCompileOptions : NSObject
// Deprecated in macOS 15 in favour of mathMode and mathFloatingPointFunctions.
@property(readwrite, nonatomic) BOOL fastMathEnabled;
@property(readwrite, nonatomic) MTLLanguageVersion languageVersion;
@property(readwrite, nonatomic) MTLMathMode mathMode RLX_STUB_MACOS(15.0);
@property(readwrite, nonatomic)
    MTLMathFloatingPointFunctions mathFloatingPointFunctions RLX_STUB_MACOS(15.0);
@end

@protocol MTLComputePipelineState <NSObject>
@property(readonly) NSUInteger maxTotalThreadsPerThreadgroup;
@end

@protocol MTLResource <NSObject>
@end

@protocol MTLBuffer <MTLResource>
- (void*)contents;
@property(readonly) NSUInteger length;
@end

@protocol MTLSharedEvent <NSObject>
@end

@protocol MTLDevice <NSObject>
- (id<MTLLibrary>)newLibraryWithSource:(NSString*)source
                               options:(MTLCompileOptions*)options
                                 error:(NSError**)error;
- (id<MTLComputePipelineState>)newComputePipelineStateWithFunction:(id<MTLFunction>)computeFunction
                                                             error:(NSError**)error;
@end

@protocol MTLCommandEncoder <NSObject>
- (void)endEncoding;
@end

@protocol MTLComputeCommandEncoder <MTLCommandEncoder>
- (void)setComputePipelineState:(id<MTLComputePipelineState>)state;
- (void)setBuffer:(id<MTLBuffer>)buffer offset:(NSUInteger)offset atIndex:(NSUInteger)index;
- (void)setBytes:(const void*)bytes length:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)setThreadgroupMemoryLength:(NSUInteger)length atIndex:(NSUInteger)index;
- (void)dispatchThreadgroups:(MTLSize)threadgroupsPerGrid
       threadsPerThreadgroup:(MTLSize)threadsPerThreadgroup;
@end

@protocol MTLCommandBuffer <NSObject>
- (id<MTLComputeCommandEncoder>)computeCommandEncoder;
- (void)commit;
@end

typedef void (^MTLCommandBufferHandler)(id<MTLCommandBuffer>);

@protocol MTLCommandQueue <NSObject>
@end

#ifdef __cplusplus
extern "C"
#endif
    id<MTLDevice>
    MTLCreateSystemDefaultDevice(void);
