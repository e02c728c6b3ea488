//! The clocks every crate reads: the wall clock for times that leave the process (stored
//! records, OpenAI's `created`, KV-event timestamps, ejection deadlines) and a monotonic clock
//! for router-local memories that must never step.

use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// Milliseconds since the Unix epoch (0 if the clock reads earlier).
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}

/// Whole seconds since the Unix epoch (OpenAI's `created`).
pub fn unix_seconds() -> u64 {
    unix_ms() / 1000
}

/// Seconds since the Unix epoch, with a fraction (vLLM's KV-event timestamps).
pub fn unix_seconds_f64() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |elapsed| elapsed.as_secs_f64())
}

/// Milliseconds since this process first asked: a clock that never steps.
pub fn monotonic_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = START.get_or_init(Instant::now).elapsed();
    u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
}

/// (year, month 1-12, day 1-31) of a count of days since 1970-01-01, in the proleptic
/// Gregorian calendar (Howard Hinnant's `civil_from_days`): what a wall time prints as.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era =
        (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 {
        month_index + 3
    } else {
        month_index - 9
    } as u32;
    (year_of_era + era * 400 + i64::from(month <= 2), month, day)
}

/// Days since 1970-01-01 of a proleptic Gregorian date (the inverse of [`civil_from_days`]
/// for month 1-12 and a day that exists in it).
pub fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let (month, day) = (i64::from(month), i64::from(day));
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let day_of_year = (153 * (month + if month > 2 { -3 } else { 9 }) + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_and_dates_convert_both_ways() {
        for (days, date) in [
            (0, (1970, 1, 1)),
            (-1, (1969, 12, 31)),
            (59, (1970, 3, 1)),
            (11_016, (2000, 2, 29)),
            (11_017, (2000, 3, 1)),
            (20_427, (2025, 12, 5)),
            (-719_468, (0, 3, 1)),
            // Century years: 1900 and 2100 are not leap years, 1600 is (checked with Python's
            // datetime, an independent calendar).
            (-25_509, (1900, 2, 28)),
            (-25_508, (1900, 3, 1)),
            (47_540, (2100, 2, 28)),
            (47_541, (2100, 3, 1)),
            (-135_081, (1600, 2, 29)),
        ] {
            assert_eq!(civil_from_days(days), date, "{days}");
            assert_eq!(days_from_civil(date.0, date.1, date.2), days, "{date:?}");
        }
        for days in (-800_000..800_000).step_by(997) {
            let (year, month, day) = civil_from_days(days);
            assert!((1..=12).contains(&month) && (1..=31).contains(&day));
            assert_eq!(days_from_civil(year, month, day), days);
        }
    }

    #[test]
    fn the_clocks_move_forward() {
        let (wall, monotonic) = (unix_ms(), monotonic_ms());
        assert!(wall > 1_600_000_000_000, "{wall}");
        assert!(unix_seconds() >= wall / 1000);
        assert!(unix_seconds_f64() >= (wall / 1000) as f64);
        assert!(monotonic_ms() >= monotonic);
    }
}
