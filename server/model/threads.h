// Per-thread control of LibTorch's intra-op parallelism.
#ifndef COLLABSERVE_SERVER_MODEL_THREADS_H_
#define COLLABSERVE_SERVER_MODEL_THREADS_H_

namespace collabserve::model {

// Sets the calling thread's ATen intra-op thread count to n without changing the default of the
// threads started later (at::set_num_threads would: with OpenMP it also stores the process-wide
// default, the inference threads' included). OpenMP's count is per thread and ATen initialises it
// lazily on a thread's first parallel op, so that happens first. omp_set_num_threads is looked up
// at run time: a LibTorch without OpenMP has one shared pool, which is left as it is.
void SetThisThreadIntraOpThreads(int n);

}  // namespace collabserve::model

#endif  // COLLABSERVE_SERVER_MODEL_THREADS_H_
