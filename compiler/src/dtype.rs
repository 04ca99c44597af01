//! The element types a tensor can hold: what the graph, the memory plan
//! and the runtime all speak of, so it sits below each of them.

use serde::Serialize;
use std::fmt;

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug, PartialOrd, Ord)]
pub enum DType {
    F32,
    BF16,
    F16,
    I32,
}

impl DType {
    pub fn parse(s: &str) -> Option<DType> {
        Some(match s {
            "f32" | "fp32" => DType::F32,
            "bf16" => DType::BF16,
            "f16" | "fp16" => DType::F16,
            "i32" => DType::I32,
            _ => return None,
        })
    }
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            DType::I32 => "i32",
        }
    }
    pub fn is_float(self) -> bool {
        !matches!(self, DType::I32)
    }
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 | DType::F16 => 2,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for DType {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}
