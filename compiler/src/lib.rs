//! fusec's compiler: model files in, a checked training graph out.
pub mod autodiff;
pub mod diag;
pub mod driver;
pub mod dsl;
pub mod elaborate;
pub mod emit;
pub mod export;
pub mod gradcheck;
pub mod interp;
pub mod ir;
pub mod kernel;
pub mod model;
pub mod ops;
pub mod passes;
pub mod plan;
pub mod recompute;
pub mod select;
