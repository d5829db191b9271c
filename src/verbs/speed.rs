//! A port's link rate: `ibv_query_port`'s `active_width` (lanes) times `active_speed` (per lane).
//!
//! | `active_width` | lanes |   | `active_speed` | name  | Gb/s per lane |
//! |---------------:|------:|---|---------------:|-------|--------------:|
//! | 1              | 1     |   | 1              | SDR   | 2.5           |
//! | 2              | 4     |   | 2              | DDR   | 5             |
//! | 4              | 8     |   | 4              | QDR   | 10            |
//! | 8              | 12    |   | 8              | FDR10 | 10            |
//! | 16             | 2     |   | 16             | FDR   | 14            |
//! |                |       |   | 32             | EDR   | 25            |
//! |                |       |   | 64             | HDR   | 50            |
//! |                |       |   | 128            | NDR   | 100           |
//!
//! The per-lane rates are the data rates `ibv_devinfo` and the InfiniBand specification name
//! (FDR's 14.0625 and EDR's 25.78125 Gbaud signalling rounded as they are). XDR (200 Gb/s per
//! lane) is reported only through `active_speed_ex`, which the linked libibverbs headers lack:
//! such a port gives `None`, as does any code outside the table. RoCE drivers map the Ethernet
//! speed onto the same codes (a 100 GbE port: 4 lanes of EDR or 2 of HDR); rxe reports its
//! netdev's speed this way, and a netdev that reports none (virtio-net) as the driver's default.

/// Lanes of an `active_width` code.
pub(crate) fn lanes(active_width: u8) -> Option<u32> {
    Some(match active_width {
        1 => 1,
        2 => 4,
        4 => 8,
        8 => 12,
        16 => 2,
        _ => return None,
    })
}

/// Gb/s per lane of an `active_speed` code.
pub(crate) fn lane_gbps(active_speed: u8) -> Option<f64> {
    Some(match active_speed {
        1 => 2.5,
        2 => 5.0,
        4 | 8 => 10.0,
        16 => 14.0,
        32 => 25.0,
        64 => 50.0,
        128 => 100.0,
        _ => return None,
    })
}

/// The port's rate in Gb/s: lanes times the per-lane rate; `None` for a code outside the table.
pub(crate) fn gbps(active_width: u8, active_speed: u8) -> Option<f64> {
    Some(f64::from(lanes(active_width)?) * lane_gbps(active_speed)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn width_times_speed_is_the_port_rate() {
        assert_eq!(gbps(1, 1), Some(2.5)); // 1x SDR
        assert_eq!(gbps(2, 4), Some(40.0)); // 4x QDR
        assert_eq!(gbps(2, 8), Some(40.0)); // 4x FDR10
        assert_eq!(gbps(2, 16), Some(56.0)); // 4x FDR
        assert_eq!(gbps(2, 32), Some(100.0)); // 4x EDR: 100 GbE
        assert_eq!(gbps(16, 64), Some(100.0)); // 2x HDR
        assert_eq!(gbps(2, 64), Some(200.0)); // 4x HDR
        assert_eq!(gbps(2, 128), Some(400.0)); // 4x NDR
        assert_eq!(gbps(4, 2), Some(40.0)); // 8x DDR
        assert_eq!(gbps(8, 4), Some(120.0)); // 12x QDR
        assert_eq!(gbps(1, 32), Some(25.0)); // 1x EDR: 25 GbE
        assert_eq!(gbps(3, 1), None);
        assert_eq!(gbps(1, 0), None);
        assert_eq!(gbps(0, 0), None);
    }
}
