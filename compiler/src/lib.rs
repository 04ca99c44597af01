//! fusec's compiler: model files in, a checked training graph out.
pub mod diag;
pub mod dsl;
pub mod interp;
pub mod ir;
pub mod ops;
pub mod elaborate;
pub mod model;
pub mod autodiff;
pub mod driver;
pub mod gradcheck;
