//! The plan's own invariants, checked after planning in every build as the
//! graph is after every pass: two buffers alive at once never share bytes,
//! every buffer lies inside the arena, storage shared on purpose (an
//! update in place, a result over its last-read input) sits at its
//! owner's offset, and every launch names buffers that exist. A plan that
//! broke one would corrupt values on the GPU with no error at all.

use super::{Plan, ALIGN};

impl Plan {
    pub fn verify(&self) -> Result<(), Vec<String>> {
        let mut problems = Vec::new();
        let n = self.buffers.len();
        for b in &self.buffers {
            if b.offset % ALIGN != 0 {
                problems.push(format!(
                    "buffer {} ({}) starts at {}, not a multiple of {ALIGN}",
                    b.id, b.name, b.offset
                ));
            }
            if b.offset
                .checked_add(b.bytes)
                .is_none_or(|end| end > self.arena_bytes)
            {
                problems.push(format!(
                    "buffer {} ({}) ends past the arena's {} bytes",
                    b.id, b.name, self.arena_bytes
                ));
            }
            for owner in [b.alias_of, b.shares_with].into_iter().flatten() {
                match self.buffers.get(owner) {
                    Some(o) if o.offset == b.offset => {}
                    Some(o) => problems.push(format!(
                        "buffer {} ({}) is stored over buffer {owner} but starts at {}, not {}",
                        b.id, b.name, b.offset, o.offset
                    )),
                    None => problems.push(format!(
                        "buffer {} is stored over buffer {owner}, which does not exist",
                        b.id
                    )),
                }
            }
        }
        // Owners of storage: a buffer alive for the whole step (`live` is
        // None) clashes with every other; two temporaries only where their
        // kernel ranges meet.
        let mut owners: Vec<&super::PlannedBuffer> = self
            .buffers
            .iter()
            .filter(|b| b.alias_of.is_none() && b.shares_with.is_none() && b.bytes > 0)
            .collect();
        owners.sort_by_key(|b| b.offset);
        for (i, a) in owners.iter().enumerate() {
            // Sorted by offset: only the buffers starting before `a` ends can
            // share a byte with it.
            for b in owners[i + 1..]
                .iter()
                .take_while(|b| b.offset < a.offset + a.bytes)
            {
                let meet = match (a.live, b.live) {
                    (Some(x), Some(y)) => x.0 <= y.1 && y.0 <= x.1,
                    _ => true,
                };
                if meet {
                    problems.push(format!(
                        "buffers {} ({}) and {} ({}) share bytes {}..{} while both are alive",
                        a.id,
                        a.name,
                        b.id,
                        b.name,
                        b.offset,
                        (a.offset + a.bytes).min(b.offset + b.bytes)
                    ));
                }
            }
        }
        for l in &self.launches {
            if let Some(b) = l.inputs.iter().chain(&l.outputs).find(|&&b| b >= n) {
                problems.push(format!(
                    "{} names buffer {b}, which does not exist",
                    l.kernel
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems)
        }
    }
}
