//! Writing a model back out in another framework's terms. `torch` writes a
//! PyTorch module that computes what the model file means, from the graph
//! elaboration made (before any pass), with the file's blocks, names and
//! `repeat`s as modules, parameter paths and loops.

pub mod torch;
