// Stub of <Foundation/Foundation.h> for the Metal host code on Linux: the -fsyntax-only check
// (clang -fobjc-runtime=gnustep-2.0) and the mock-runtime build (-fobjc-runtime=gcc, whose
// implementations live in tests/metal_emu/mock/). Declares exactly the API rlx and the torch
// MPS headers use, transcribed from Apple's documentation
// (developer.apple.com/documentation/foundation). A method missing here is an error
// (-Werror=objc-method-access), so a misspelt selector fails.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <dispatch/dispatch.h>

typedef unsigned long NSUInteger;
typedef long NSInteger;
typedef signed char BOOL;
#define YES ((BOOL)1)
#define NO ((BOOL)0)
#ifndef nil
#define nil nullptr  // objc/objc.h: nil is nullptr in Objective-C++
#endif

@class NSString;
@class NSDictionary;

@protocol NSObject
- (instancetype)retain;
- (oneway void)release;
- (instancetype)autorelease;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject> {
  Class isa;
}
+ (instancetype)alloc;
- (instancetype)init;
@end

@interface NSString : NSObject
+ (instancetype)stringWithUTF8String:(const char*)nullTerminatedCString;
@property(readonly) const char* UTF8String;
@end

@interface NSError : NSObject
@property(readonly, copy) NSString* localizedDescription;
@end
