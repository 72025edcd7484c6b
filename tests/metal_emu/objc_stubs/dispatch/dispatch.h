// Stub of <dispatch/dispatch.h> for compile-checking the Metal host code on Linux
// (clang -fsyntax-only). Declares only what rlx uses, with the signatures of Apple's
// documentation (developer.apple.com/documentation/dispatch).
#pragma once

typedef struct dispatch_queue_s* dispatch_queue_t;
typedef void (^dispatch_block_t)(void);

// Submits a block for synchronous execution on a dispatch queue.
void dispatch_sync(dispatch_queue_t queue, dispatch_block_t block);
