//! What elaboration inlines away but a reader of the model wants back: which
//! block call made which nodes, which `repeat` stacked them, and the `let`
//! names of tensors. The graph does not need it; `fusec export-torch` does,
//! to write the model as PyTorch modules with the model file's names.

use super::values::Val;
use crate::ir::Value;
use std::collections::HashMap;

/// One call of a block, or one layer of a `repeat`.
#[derive(Clone, Debug)]
pub struct CallRecord {
    /// The block definition called.
    pub block: String,
    /// The instance path, as parameter names spell it: `h.3.attn`.
    pub path: String,
    /// The block's parameter names with the values passed for them.
    pub args: Vec<(String, Val)>,
    pub result: Val,
    /// Nodes `first..end` were added during the call (nested calls included):
    /// elaboration adds nodes in order and never removes one.
    pub first: usize,
    pub end: usize,
}

/// `repeat N block(x, ...)`: the layers are calls `path.0` .. `path.{N-1}`.
#[derive(Clone, Debug)]
pub struct RepeatRecord {
    pub block: String,
    pub path: String,
    pub count: usize,
    pub first: usize,
    pub end: usize,
}

#[derive(Clone, Debug, Default)]
pub struct Structure {
    pub calls: Vec<CallRecord>,
    pub repeats: Vec<RepeatRecord>,
    /// `let` names by scope (the instance path, `""` at the top level): the
    /// first name a tensor is bound to in that scope.
    pub names: HashMap<(String, Value), String>,
}

impl Structure {
    pub(crate) fn name(&mut self, scope: &str, val: &Val, name: &str) {
        if let Val::Tensor(v) = val {
            self.names
                .entry((scope.to_string(), *v))
                .or_insert_with(|| name.to_string());
        }
    }
}
