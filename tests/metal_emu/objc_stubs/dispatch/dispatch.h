// Stub of <dispatch/dispatch.h> for the Metal host code on Linux (see Foundation/Foundation.h).
// Declares only what rlx and the torch MPS headers use, with the signatures of Apple's
// documentation (developer.apple.com/documentation/dispatch).
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);

#ifdef __cplusplus
extern "C" {
#endif
// Submits a block for synchronous execution on a dispatch queue.
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
#ifdef __cplusplus
}
#endif
