// Stub of <Foundation/Foundation.h> for compile-checking the Metal host code on Linux
// (clang -fsyntax-only -x objective-c++ -fobjc-runtime=gnustep-2.0). Declares exactly the API
// rlx uses, transcribed from Apple's documentation (developer.apple.com/documentation/foundation).
// A method missing here is an error (-Werror=objc-method-access), so a misspelt selector fails.
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

@protocol NSObject
- (oneway void)release;
@end

__attribute__((objc_root_class))
@interface NSObject <NSObject>
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
