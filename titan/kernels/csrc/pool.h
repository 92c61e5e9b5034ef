// Work sharing for the narrow-step kernels (products and attention of decode rows): a job is cut into
// chunks that the calling thread and the pool's workers claim one at a time, so the caller waits only for
// chunks that are in progress, never for a worker that has not woken up. An OpenMP region ends in a
// barrier that waits for every thread of the team: when the OS runs something else on one core for a
// moment (the server's event loop writing a token, a neighbour process), the whole region waits for it;
// here the other threads take over its share of the chunks instead.
#pragma once
#include <cstdint>
#include <functional>

// body(begin, end) over [0, total) in chunks of `chunk`, on the calling thread and up to
// at::get_num_threads() - 1 workers. Jobs from several calling threads run one after another.
void parallel_chunks(int64_t total, int64_t chunk, const std::function<void(int64_t, int64_t)>& body);
