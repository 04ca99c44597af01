//! The text of one attention kernel: an `extern "C"` wrapper with the plan
//! kernel's signature that fills the template's arguments from the views
//! the op reads and writes, and runs one `kernels/attention/` template
//! instance. Nothing of the algorithm is written here.

use super::templates::Instance;
use super::tma::{host_maps, TensorMap};
use super::Config;
use crate::emit::access::Access;
use crate::emit::cuda::{float_lit, header_comment, signature};
use crate::emit::templates::Ctx;
use crate::emit::PRELUDE_NAME;
use crate::ir::Graph;
use std::fmt::Write;

/// What the template's argument struct gets, as C assignments.
pub(crate) struct Fill {
    pub(crate) lines: Vec<String>,
}

impl Fill {
    pub(crate) fn new() -> Fill {
        Fill { lines: Vec::new() }
    }

    /// `a.<field> = {ptr + offset, batch, row, head strides};` for op input
    /// or output `access`, a `[B, T, H, D]` view.
    pub(crate) fn heads(&mut self, field: &str, access: &Access) {
        let s = access.strides();
        self.lines.push(format!(
            "a.{field} = {{{}, {}, {}, {}}};",
            pointer(access),
            s[0].to_c(),
            s[1].to_c(),
            s[2].to_c()
        ));
    }

    /// `a.<field> = {ptr + offset, batch, head, row strides};` for an f32
    /// `[B, H, T]` view.
    pub(crate) fn rows(&mut self, field: &str, access: &Access) {
        let s = access.strides();
        self.lines.push(format!(
            "a.{field} = {{{}, {}, {}, {}}};",
            pointer(access),
            s[0].to_c(),
            s[1].to_c(),
            s[2].to_c()
        ));
    }

    pub(crate) fn set(&mut self, field: &str, value: String) {
        self.lines.push(format!("a.{field} = {value};"));
    }
}

fn pointer(a: &Access) -> String {
    match a.offset().as_const() {
        Some(0) => a.ptr.clone(),
        _ => format!("{} + {}", a.ptr, a.offset().to_c()),
    }
}

/// The sizes and flags every attention template's arguments share.
pub(crate) fn fill_sizes(f: &mut Fill, cfg: &Config) {
    f.set("batch", cfg.batch.to_c());
    f.set("q_heads", cfg.q_heads.to_c());
    f.set("q_len", cfg.q_len.to_c());
    f.set("kv_len", cfg.kv_len.to_c());
    f.set("group", cfg.group.to_string());
    f.set(
        "scale_log2",
        float_lit(cfg.scale * std::f64::consts::LOG2_E),
    );
    if let Some(lens) = &cfg.lengths {
        f.set("kv_lens", lens.clone());
    }
    if let Some((d, key)) = &cfg.dropout {
        f.set("drop.key", key.clone());
        f.set("drop.site", format!("{}u", d.site));
        f.set("drop.threshold", format!("{}u", d.threshold()));
        f.set("drop.scale", float_lit(d.scale()));
    }
}

/// The whole source of kernel `name`: the plan kernel's comment, the
/// includes, the instance with its checked constants, and the wrapper,
/// which fills `args_type` from `fill` and calls `run(a, <maps>)`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn kernel(
    g: &Graph,
    c: &Ctx,
    source: Option<&str>,
    name: &str,
    about: &str,
    inst: &Instance,
    args_type: &str,
    fill: &Fill,
    scratch: bool,
    maps: &[TensorMap],
) -> String {
    let k = c.k;
    let mut s = header_comment(g, k, name, source);
    let _ = writeln!(s, "#include \"{PRELUDE_NAME}\"");
    let _ = writeln!(s, "#include \"{}\"\n", inst.header);
    for line in about.lines() {
        let _ = writeln!(s, "// {line}");
    }
    let t = format!("{name}_t");
    let _ = writeln!(s, "typedef {} {t};", inst.ty);
    let checks: Vec<String> = inst
        .checks
        .iter()
        .map(|(c, v)| format!("{t}::{c} == {v}"))
        .collect();
    let _ = writeln!(
        s,
        "static_assert({}, \"the launch fusec worked out for this instance\");\n",
        checks.join(" && ")
    );
    let mut extra = Vec::new();
    if scratch {
        extra.push(",\n    float* scratch /* f32, shared by the backward's kernels */".to_string());
    }
    for m in maps {
        extra.push(format!("\n    FS_TMAP_PARAM({})", m.name));
    }
    s.push_str(&signature(g, c.p, k, name, Some(&inst.bounds), &extra));
    if !maps.is_empty() {
        s.push_str(&host_maps(maps));
    }
    let _ = writeln!(s, "    fs_attn::{args_type} a;");
    for line in &fill.lines {
        let _ = writeln!(s, "    {line}");
    }
    if scratch {
        let _ = writeln!(s, "    a.scratch = scratch;");
    }
    let run_args: String = maps.iter().map(|m| format!(", {}", m.name)).collect();
    let _ = writeln!(s, "    {t}::run(a{run_args});\n}}");
    s
}
