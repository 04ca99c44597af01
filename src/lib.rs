//! fusec as a library: the backends `fusec train` drives. Each joins the
//! compiler's graph (the names, shapes and initialisers of a model's
//! inputs and parameters) to what runs the step: the compiled step on a
//! GPU (`fusec_runtime`, which reads the compiled step alone), the CPU
//! reference interpreter, or several data-parallel ranks of either.

pub mod backend;
