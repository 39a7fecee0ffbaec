//! [`SlotId`], the one name of a pool slot, and [`RowSlot`], what one row
//! of a step runs with: the base model or a slot.
//!
//! The kernels read rows as `i32` with `-1` for the base model; that
//! encoding lives here and nowhere else in the public API.

use std::fmt;

/// A slot of a [`LoraPool`](crate::LoraPool): an index below `max_loras`.
/// The pool checks the range wherever one is passed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SlotId(usize);

impl SlotId {
    /// The slot with index `index`.
    pub const fn new(index: usize) -> SlotId {
        SlotId(index)
    }

    /// The slot's index, `0..max_loras`.
    pub const fn index(self) -> usize {
        self.0
    }
}

impl fmt::Display for SlotId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// What one row (decode) or sequence (prefill) of a step runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowSlot {
    /// The base model: no delta.
    Base,
    /// The adapter in this slot.
    Slot(SlotId),
}

impl RowSlot {
    /// The slot, unless the row runs the base model.
    pub fn slot(self) -> Option<SlotId> {
        match self {
            RowSlot::Base => None,
            RowSlot::Slot(s) => Some(s),
        }
    }

    /// The kernels' encoding: the slot index, `-1` for the base model. The
    /// pool keeps `max_loras` within `i32`.
    pub(crate) fn kernel_value(self) -> i32 {
        match self {
            RowSlot::Base => -1,
            RowSlot::Slot(s) => i32::try_from(s.index()).unwrap_or(-1),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base_is_a_variant_and_slots_encode_as_their_index() {
        assert_eq!(RowSlot::Base.kernel_value(), -1);
        assert_eq!(RowSlot::Slot(SlotId::new(3)).kernel_value(), 3);
        assert_eq!(RowSlot::Slot(SlotId::new(3)).slot(), Some(SlotId::new(3)));
        assert_eq!(RowSlot::Base.slot(), None);
        assert_eq!(SlotId::new(7).to_string(), "7");
    }
}
